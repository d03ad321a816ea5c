"""Third-party peers of the sparse cases: FlexAttention (torch), FastVideo's Triton kernels
(the ``fastvideo-kernel`` package, used without its compiled extension) and FastVideo's
ThunderKittens Hopper kernel (the module ``tk_vsa`` that tools/peers/thunderkittens_peer.sh
builds; the bench loads it from the file named by ``VIDATTN_TK_VSA``).

Nothing here is imported by vidattn itself; every peer is optional, and a missing one is
reported as an unavailable row, not an error.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

# ---- FastVideo (fastvideo-kernel) -----------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _fastvideo_import():
    """``(module, None)`` or ``(None, reason)``. Its Triton kernels need no compiled extension:
    ``fastvideo_kernel._C`` missing is fine (block_sparse_attn falls back to Triton)."""
    try:
        import fastvideo_kernel  # noqa: F401
        import fastvideo_kernel.block_sparse_attn  # noqa: F401
    except Exception as e:  # ImportError, or an import-time failure of one of its modules
        return None, f"fastvideo-kernel not importable ({type(e).__name__}: {str(e)[:120]})"
    return fastvideo_kernel, None


def fastvideo_unavailable(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return "fastvideo-kernel: CUDA only (Triton)"
    return _fastvideo_import()[1]


def fastvideo_info() -> dict:
    """Version, location and whether the compiled extension is present, for the JSON."""
    module, reason = _fastvideo_import()
    if module is None:
        return {"available": False, "reason": reason}
    try:
        from fastvideo_kernel import _C  # noqa: F401

        compiled = True
    except Exception:
        compiled = False
    return {"available": True, "version": getattr(module, "__version__", None),
            "path": getattr(module, "__file__", None), "compiled_extension": compiled}


# ---- FastVideo's ThunderKittens kernel (tk_vsa) -----------------------------------------------


@functools.lru_cache(maxsize=None)
def _tk_import():
    import importlib.util
    import os

    path = os.environ.get("VIDATTN_TK_VSA")
    if not path:
        return None, "fastvideo-tk: set VIDATTN_TK_VSA to the tk_vsa.so that " \
                     "tools/peers/thunderkittens_peer.sh builds"
    try:
        spec = importlib.util.spec_from_file_location("tk_vsa", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # a missing or broken build is an unavailable peer, not an error
        return None, f"fastvideo-tk: {path} not loadable ({type(e).__name__}: {str(e)[:120]})"
    return module, None


def tk_module():
    return _tk_import()[0]


def tk_unavailable(device: torch.device) -> Optional[str]:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "fastvideo-tk: sm_90 GPUs only"
    return _tk_import()[1]


def tk_info() -> dict:
    module, reason = _tk_import()
    return {"available": module is not None, "reason": reason, "path": getattr(module, "__file__", None)}


def invert_selection(q2k_index: torch.Tensor, q2k_count: torch.Tensor,
                     kv_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key-tile -> query-tiles lists of a selection: int32 ``[B, H, Kt, MaxQ]`` ascending
    (unused entries -1) and counts ``[B, H, Kt]``."""
    B, H, Qt, K = q2k_index.shape
    slot = torch.arange(K, device=q2k_index.device)
    valid = slot < q2k_count[..., None].long()
    mask = torch.zeros(B, H, Qt, kv_tiles + 1, dtype=torch.bool, device=q2k_index.device)
    mask.scatter_(3, torch.where(valid, q2k_index.long(), kv_tiles), True)
    k2q = mask[..., :kv_tiles].transpose(2, 3)  # [B, H, Kt, Qt]
    count = k2q.sum(-1, dtype=torch.int32)
    max_q = max(int(count.max()), 1)
    rows = torch.arange(Qt, device=q2k_index.device).expand_as(k2q)
    order = torch.where(k2q, rows, Qt).sort(-1).values[..., :max_q]
    index = torch.where(order < Qt, order, -1).to(torch.int32).contiguous()
    return index, count.contiguous()


# ---- FlexAttention ---------------------------------------------------------------------------


def flex_unavailable(device: torch.device) -> Optional[str]:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"FlexAttention not in this torch ({e})"
    return None


def selection_to_dense_mask(index: torch.Tensor, count: torch.Tensor,
                            kv_tiles: int) -> torch.Tensor:
    """bool ``[B, H, Qt, Kt]``: True where query tile t selected key tile j (the first
    ``count[b, h, t]`` slots of ``index[b, h, t]``)."""
    slots = torch.arange(index.shape[-1], device=index.device)
    picked = torch.where(slots < count[..., None].long(), index.long(), kv_tiles)
    mask = torch.zeros(*index.shape[:-1], kv_tiles + 1, dtype=torch.bool, device=index.device)
    mask.scatter_(-1, picked, True)
    return mask[..., :kv_tiles]


def selection_to_block_mask(q2k_index: torch.Tensor, q2k_count: torch.Tensor, q_len: int,
                            kv_len: int, tile: int):
    """FlexAttention's BlockMask of a tile selection: query tile t attends to key tiles
    ``q2k_index[b, h, t, :q2k_count[b, h, t]]``, ``tile`` x ``tile`` blocks. The tiles are whole
    (no token masked), so every selected block is a *full* block: the compiled kernel then runs
    no mask function inside it, the same work as a block-sparse kernel. The mask function
    (the selection, token by token) is there for eager FlexAttention, which ignores the block
    structure and computes every score: without it eager mode would attend densely."""
    from torch.nn.attention.flex_attention import BlockMask

    count = q2k_count.to(torch.int32).contiguous()
    kv_tiles = kv_len // tile
    slots = torch.arange(q2k_index.shape[-1], device=q2k_index.device)
    # BlockMask's index rows are as wide as the key tiles (it builds its transposed index
    # from a dense map of that width); slots past the count are ignored: fill them with 0.
    index = torch.zeros(*q2k_index.shape[:-1], kv_tiles, dtype=torch.int32,
                        device=q2k_index.device)
    index[..., :q2k_index.shape[-1]] = torch.where(slots < count[..., None], q2k_index, 0)
    allowed = selection_to_dense_mask(q2k_index, count, kv_tiles)

    def selected(b, h, q_idx, kv_idx):
        return allowed[b, h, q_idx // tile, kv_idx // tile]

    no_partial = torch.zeros_like(count)
    return BlockMask.from_kv_blocks(no_partial, torch.zeros_like(index), count, index,
                                    BLOCK_SIZE=(tile, tile), seq_lengths=(q_len, kv_len),
                                    mask_mod=selected)


@functools.lru_cache(maxsize=None)
def flex_function(device_type: str):
    """``flex_attention`` compiled for the GPU (how it is meant to run); eager on the CPU, where
    it only checks the plumbing on tiny shapes (and compiling would take minutes)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    from . import flex_configs

    flex_configs.install()  # 64-token BlockMasks compile on Hopper too
    return torch.compile(flex_attention, dynamic=False)
