"""Sequence-parallel attention over ``torch.distributed`` (Ulysses style all-to-all).

Each rank holds a contiguous shard of the sequence with all heads. One all-to-all turns that
into the full sequence with ``H / world`` heads, attention runs on it, and the reverse
all-to-all gives every rank its shard back. Everything is built from ops with autograd
(vidattn's ops and torch's functional collectives, whose backward is the reverse
collective), so training works, and ``torch.compile(fullgraph=True)`` traces the whole layer
without graph breaks.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._attention import attention
from .rope import apply_rope

_BACKENDS = ("dense", "vsa")


def _group_size_and_rank(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("DistributedAttention: a process group was given but "
                             "torch.distributed is not initialized")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _resolve_group(group):
    # The functional collectives take no None for the default group.
    return dist.group.WORLD if group is None else group


def _all_to_all_start(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """Issues the all-to-all of _all_to_all and returns its not-yet-waited output: work on
    the current stream may overlap it until wait_tensor."""
    from torch.distributed import _functional_collectives as funcol
    splits = [x.shape[0] // world] * world
    return torch.ops._c10d_functional.all_to_all_single(
        x, splits, splits, funcol._resolve_group_name(group))


def _all_to_all(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """All-to-all along dim 0 (chunk j goes to rank j; chunks received in rank order).

    torch's functional collective op, whose autograd (registered on the op) is the reverse
    all-to-all of the contiguous gradient. (The `_c10d_functional_autograd` variant behind
    `all_to_all_single_autograd` rejects the non-contiguous gradients that the permutes
    around it produce.)"""
    return torch.ops._c10d_functional.wait_tensor(_all_to_all_start(x, world, group))


def _sequence_to_heads(xs: Sequence[torch.Tensor], world: int, group) -> List[torch.Tensor]:
    """Local shards [B, S_local, H_i, D_i] -> [B, world * S_local, H_i / world, D_i] (this
    rank's head group, full padded sequence), all tensors in one collective."""
    b, s_local = xs[0].shape[0], xs[0].shape[1]
    # [B, S_local, world, H_i / world * D_i], heads grouped by destination rank; the cat of
    # the permuted views is the (only) copy into the send buffer [world, B, S_local, F].
    widths = [x.shape[2] // world * x.shape[3] for x in xs]
    parts = [x.reshape(b, s_local, world, w).permute(2, 0, 1, 3) for x, w in zip(xs, widths)]
    send = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=-1)
    recv = _all_to_all(send, world, group)  # [world (sequence chunk), B, S_local, F]
    full = recv.permute(1, 0, 2, 3).reshape(b, world * s_local, sum(widths))
    return [chunk.unflatten(-1, (x.shape[2] // world, x.shape[3]))
            for chunk, x in zip(torch.split(full, widths, dim=-1), xs)]


def _heads_to_sequence(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """[B, world * S_local, H / world, D] -> [B, S_local, H, D]: the inverse of
    _sequence_to_heads."""
    b, s_full, h_local, d = x.shape
    s_local = s_full // world
    send = x.reshape(b, world, s_local, h_local * d).permute(1, 0, 2, 3).contiguous()
    recv = _all_to_all(send, world, group)  # [world (head group), B, S_local, H / world * D]
    return recv.permute(1, 2, 0, 3).reshape(b, s_local, world * h_local, d)


def _gather_heads(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """[B, L, H / world, D] on every rank -> [B, L, H, D] (heads in rank order). The op's
    autograd reduce-scatters (sums) the gradient over the ranks."""
    from torch.distributed import _functional_collectives as funcol
    send = x.permute(2, 0, 1, 3).contiguous()  # heads first: all_gather works along dim 0
    full = torch.ops._c10d_functional.all_gather_into_tensor(
        send, world, funcol._resolve_group_name(group))
    full = torch.ops._c10d_functional.wait_tensor(full)  # [H, B, L, D]
    return full.permute(1, 2, 0, 3).contiguous()


class DistributedAttention(torch.nn.Module):
    """Sequence-parallel attention (dense or VSA) over a ``torch.distributed`` group.

    ``DistributedAttention(backend="dense", *, group=None, scale=None, interleaved_rope=True,
    tiling=None, topk=None, sparsity=None, head_chunks=None, sm_margin=None)``

    ``forward(q, k, v, *, seq_len=None, cos=None, sin=None, replicated_q=None,
    replicated_k=None, replicated_v=None, gate=None)``

    Sharding: every rank passes its shard ``[B, S_local, H, D]`` of q, k, v (``[B, S_local,
    Hkv, Dv]`` for v; Hkv may be smaller than H for grouped heads). The global sequence is the
    shards of ranks 0, 1, ... back to back, ``world * S_local`` tokens, of which the first
    ``seq_len`` (default: all) are real and the rest padding that made the length divisible
    by the world size. Every rank must pass the same ``S_local`` and ``seq_len``. H and Hkv
    must be multiples of the world size (ValueError otherwise).

    Steps: all-to-all (scatter heads, gather the sequence); drop the padding; RoPE on q and k
    with the full-sequence tables ``cos`` / ``sin`` (``[seq_len, D]`` or ``[seq_len, D/2]``,
    see :func:`vidattn.apply_rope`; pairs as ``interleaved_rope``), if given; attention; pad
    back; reverse all-to-all. The output is this rank's shard ``[B, S_local, H, Dv]``; its
    padding rows are 0 and padded inputs get zero gradient.

    Replicated tokens (dense only): ``replicated_q/k/v`` ``[B, L, H, D]`` (e.g. text), the
    same on every rank, are sliced to this rank's heads and appended after the sequence (joint
    attention: every token attends to the sequence and the replicated tokens). RoPE is not
    applied to them. Their output is all-gathered over heads and returned:
    ``forward`` then returns ``(out, replicated_out)``, ``replicated_out`` ``[B, L, H, Dv]``.
    Gradients follow torch's autograd collectives, i.e. they are those of the sum of all
    ranks' losses: a replicated input receives the part of its gradient that flows through
    this rank's heads (sum it over the group, like any replicated parameter's gradient), and a
    loss term on ``replicated_out`` is counted once per rank (divide it by the world size, or
    compute it on one rank, to count it once in total).

    ``backend="vsa"``: :func:`vidattn.video_sparse_attention` with ``tiling`` (a
    :class:`vidattn.VideoTiling` of the full, unpadded sequence in raster order, so
    ``seq_len == tiling.num_tokens``) and ``topk`` or ``sparsity``; the layer tiles the
    gathered sequence after RoPE and untiles the result. ``gate`` (``[B, S_local, H, D]``,
    sharded like q) is optional. Replicated tokens are not supported with VSA (its tiles cover
    the video grid only). VSA is fast enough for the all-to-alls to show, so the
    layer pipelines it over head chunks of this rank's heads: chunk c + 1 travels while chunk
    c is computed, and chunk c's output travels back while chunk c + 1 is computed. What
    travels back is the fine branch alone; the coarse outputs (one row per tile, float32) are
    all-gathered, and every rank forms ``o_c * gate + o_s`` on its own rows
    (``vidattn::vsa_combine_rows``), so the gate never leaves its rank (one all-to-all fewer
    each way). Without autograd (inference, B = 1) each returned chunk is combined straight
    into the output, and the last chunk's fine attention runs in two pieces of its heads so
    that less of its return is left at the end; the result is the same bit for bit.
    ``head_chunks``: an int (that many equal chunks) or the head count of each chunk, e.g.
    ``(2, 8, 8, 2)``; default 2 equal chunks where they split evenly (on 2x H200 uneven
    chunks measured no faster, docs/perf-notes.md). Heads are independent, so the result is
    the same. With B = 1 the pipeline applies RoPE on each
    rank's own positions before the all-to-all, writing straight into the send buffers (no
    separate packing copy).
    ``sm_margin`` (default 0) is passed to the sparse kernel (see
    :func:`vidattn.block_sparse_attention`): SMs it leaves to kernels running alongside.

    World size 1 (or torch.distributed not initialized) runs with no collective.
    """

    def __init__(self, backend: str = "dense", *, group=None, scale: Optional[float] = None,
                 interleaved_rope: bool = True, tiling=None, topk: Optional[int] = None,
                 sparsity: Optional[float] = None,
                 head_chunks: Union[int, Sequence[int], None] = None,
                 sm_margin: Optional[int] = None):
        super().__init__()
        if head_chunks is not None:
            sizes = [head_chunks] if isinstance(head_chunks, int) else list(head_chunks)
            if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
                raise ValueError(f"DistributedAttention: head_chunks must be an int >= 1 or a "
                                 f"non-empty sequence of ints >= 1, got {head_chunks!r}")
        if topk is not None and int(topk) < 1:
            raise ValueError(f"DistributedAttention: topk must be >= 1, got {topk}")
        if sm_margin is not None and int(sm_margin) < 0:
            raise ValueError(f"DistributedAttention: sm_margin must be >= 0, got {sm_margin}")
        if backend not in _BACKENDS:
            raise ValueError(f"DistributedAttention: backend must be 'dense' or 'vsa', got "
                             f"{backend!r}")
        if backend == "vsa":
            if tiling is None:
                raise ValueError("DistributedAttention: backend='vsa' needs tiling= (a "
                                 "VideoTiling of the full sequence)")
            if (topk is None) == (sparsity is None):
                raise ValueError("DistributedAttention: backend='vsa' needs exactly one of "
                                 "topk= and sparsity=")
        elif tiling is not None or topk is not None or sparsity is not None:
            raise ValueError("DistributedAttention: tiling, topk and sparsity are for "
                             "backend='vsa'")
        self.backend = backend
        self.group = group
        self.scale = scale
        self.interleaved_rope = bool(interleaved_rope)
        self.tiling = tiling
        self.topk = topk
        self.sparsity = sparsity
        self.head_chunks = (head_chunks if head_chunks is None or isinstance(head_chunks, int)
                            else tuple(head_chunks))
        self.sm_margin = None if sm_margin is None else int(sm_margin)

    def extra_repr(self) -> str:
        extra = f", tiling={self.tiling!r}" if self.backend == "vsa" else ""
        return f"backend={self.backend!r}, scale={self.scale}{extra}"

    def _check(self, q, k, v, seq_len, world, cos, sin, replicated, gate):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"DistributedAttention: {name} must be a 4-D [B, S_local, H, D] "
                                 f"tensor, got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
        if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"DistributedAttention: q, k, v must share B and S_local (and k, v "
                             f"their heads), got {tuple(q.shape)}, {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        for name, t in (("q", q), ("k", k)):
            if t.shape[2] % world != 0:
                raise ValueError(
                    f"DistributedAttention: the number of heads of {name} ({t.shape[2]}) must be "
                    f"divisible by the world size ({world}): each rank takes H / world heads")
        padded = world * q.shape[1]
        if not 0 <= seq_len <= padded:
            raise ValueError(f"DistributedAttention: seq_len must be in [0, world * S_local = "
                             f"{padded}], got {seq_len}")
        if (cos is None) != (sin is None):
            raise ValueError("DistributedAttention: pass both cos and sin, or neither")
        if replicated is not None:
            if self.backend == "vsa":
                raise ValueError("DistributedAttention: replicated tokens are not supported with "
                                 "backend='vsa' (VSA tiles cover the video grid only)")
            for name, t, like in zip(("replicated_q", "replicated_k", "replicated_v"),
                                     replicated, (q, k, v)):
                if (not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != like.shape[0]
                        or t.shape[2:] != like.shape[2:] or t.shape[1] != replicated[0].shape[1]):
                    raise ValueError(
                        f"DistributedAttention: {name} must be [B, L, H, D] with B, H, D of its "
                        f"sharded counterpart {tuple(like.shape)} and one L for all three, got "
                        f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
        if gate is not None:
            if self.backend != "vsa":
                raise ValueError("DistributedAttention: gate is for backend='vsa'")
            if not isinstance(gate, torch.Tensor) or gate.shape != q.shape:
                raise ValueError(f"DistributedAttention: gate must have q's shape "
                                 f"{tuple(q.shape)}, got "
                                 f"{tuple(gate.shape) if isinstance(gate, torch.Tensor) else type(gate)}")
        if self.backend == "vsa" and seq_len != self.tiling.num_tokens:
            raise ValueError(f"DistributedAttention: the sequence has {seq_len} tokens but the "
                             f"tiling {self.tiling!r} has {self.tiling.num_tokens}")

    def _vsa(self, q, k, v, gate) -> torch.Tensor:
        """video_sparse_attention of this rank's heads over the full (unpadded) sequence,
        in and out in raster order."""
        from .vsa import video_sparse_attention
        tiling = self.tiling
        out = video_sparse_attention(
            tiling.tile(q), tiling.tile(k), tiling.tile(v), tiling=tiling, topk=self.topk,
            sparsity=self.sparsity, gate=None if gate is None else tiling.tile(gate),
            scale=self.scale, sm_margin=self.sm_margin or 0)
        return tiling.untile(out)

    def _vsa_chunk(self, arriving, finish, seq_len: int, padded: int, world: int, group,
                   before_v=None, send=None, pieces: int = 1):
        """One head chunk of the pipeline (world > 1), before the combination. ``arriving``:
        q, k, v of the chunk in some pending form, ``finish(x)`` the full-sequence tensor
        [B, seq_len, hc, D] of one (it waits for its all-to-all). The stages are queued in
        the order the inputs arrive: q and k are tiled and pooled and the selection made
        while v is still in flight; ``before_v()`` (the next chunk's packing) is queued there
        too. Returns the fine output in raster order, padded to the full length, and the
        all-gather (issued, not waited) of the float32 coarse output over the group's head
        groups, ``[world * B, Tiles, hc, Dv]``. float32, so that the coarse gradient, which
        every rank sums over its own rows, is summed across ranks before it is rounded to
        16 bits. With ``send``, the fine output is computed in ``pieces`` runs of the chunk's
        heads and each is handed to ``send(h0, h1, fine_piece)`` as soon as it is queued, so
        that its return travels while the next piece computes; the fine output returned is
        then None."""
        from torch.distributed import _functional_collectives as funcol
        from .vsa import _resolve_topk, _vsa_coarse, _vsa_fine, _vsa_pool, _vsa_select
        tiling = self.tiling
        q, k = [tiling.tile(finish(x)) for x in arriving[:2]]
        q_c, k_c = _vsa_pool(q, tiling), _vsa_pool(k, tiling)
        topk = _resolve_topk(self.topk, self.sparsity, tiling)
        selection = _vsa_select(q_c, k_c, tiling, tiling, topk, self.sparsity, self.scale)
        if before_v is not None:
            before_v()
        v = tiling.tile(finish(arriving[2]))
        o_c = _vsa_coarse(q_c, k_c, _vsa_pool(v, tiling), tiling, tiling, self.scale)
        if o_c.dtype in (torch.float16, torch.bfloat16):
            o_c = o_c.float()
        coarse = torch.ops._c10d_functional.all_gather_into_tensor(
            o_c.contiguous(), world, funcol._resolve_group_name(group))

        def fine_of(h0, h1):
            heads = slice(h0, h1)
            o_s = _vsa_fine(q[:, :, heads], k[:, :, heads], v[:, :, heads],
                            [t[:, heads] for t in selection], tiling, tiling, self.scale,
                            self.sm_margin or 0)
            fine = tiling.untile(o_s)
            if seq_len != padded:
                fine = F.pad(fine, (0, 0, 0, 0, 0, padded - seq_len))
            return fine

        hc = q.shape[2]
        if send is None:
            return fine_of(0, hc), coarse
        bounds = [hc * i // pieces for i in range(pieces + 1)]
        for h0, h1 in zip(bounds, bounds[1:]):
            if h1 > h0:
                send(h0, h1, fine_of(h0, h1))
        return None, coarse

    @staticmethod
    def _gathered_coarse(gathered, world: int) -> torch.Tensor:
        """The chunks' all-gathered coarse outputs -> ``[B, Tiles, H, Dv]`` in the heads'
        order on the home rank (head group j, then the chunks' heads)."""
        parts = []
        for g in gathered:
            g = torch.ops._c10d_functional.wait_tensor(g)
            parts.append(g.unflatten(0, (world, -1)).permute(1, 2, 0, 3, 4))
        coarse = torch.cat(parts, dim=3)  # [B, Tiles, world, h_local, Dv]
        return coarse.flatten(2, 3)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                seq_len: Optional[int] = None, cos: Optional[torch.Tensor] = None,
                sin: Optional[torch.Tensor] = None, replicated_q: Optional[torch.Tensor] = None,
                replicated_k: Optional[torch.Tensor] = None,
                replicated_v: Optional[torch.Tensor] = None,
                gate: Optional[torch.Tensor] = None):
        world, rank = _group_size_and_rank(self.group)
        group = _resolve_group(self.group) if world > 1 else None
        replicated = (replicated_q, replicated_k, replicated_v)
        if all(t is None for t in replicated):
            replicated = None
        elif any(t is None for t in replicated):
            raise ValueError("DistributedAttention: pass all of replicated_q, replicated_k and "
                             "replicated_v, or none")
        padded = world * q.shape[1]
        seq_len = padded if seq_len is None else int(seq_len)
        self._check(q, k, v, seq_len, world, cos, sin, replicated, gate)

        if self.backend == "vsa" and world > 1:
            sharded = [q, k, v]
            ranges = self._head_ranges(sharded, world)
            if q.shape[0] == 1 and _untracked(q, k, v, gate, cos, sin):
                # Inference: each chunk is combined into the output as it comes back.
                return self._vsa_pipelined_b1(sharded, world, group, seq_len, padded, cos, sin,
                                              ranges, gate=gate, combine=True)
            fine, coarse = self._vsa_pipelined(sharded, world, group, seq_len, padded, cos, sin,
                                               ranges)
            # The combination on this rank's own rows: the gate never travels.
            tiling = self.tiling
            return torch.ops.vidattn.vsa_combine_rows(
                fine, coarse, gate, tiling.token_to_slot, tiling.slot_to_token,
                tiling.tile_volume, rank * q.shape[1])

        # Full sequence, this rank's heads.
        sharded = [q, k, v]
        if world > 1:
            sharded = _sequence_to_heads(sharded, world, group)
        if seq_len != padded:
            sharded = [t[:, :seq_len] for t in sharded]
        q, k, v = sharded
        if cos is not None:
            q = apply_rope(q, cos, sin, interleaved=self.interleaved_rope)
            k = apply_rope(k, cos, sin, interleaved=self.interleaved_rope)

        replicated_out = None
        if self.backend == "dense":
            if replicated is not None:
                def local(t):  # this rank's heads
                    h = t.shape[2] // world
                    return t[:, :, rank * h:(rank + 1) * h]
                q = torch.cat([q, local(replicated[0])], dim=1)
                k = torch.cat([k, local(replicated[1])], dim=1)
                v = torch.cat([v, local(replicated[2])], dim=1)
            out = attention(q, k, v, scale=self.scale)
            if replicated is not None:
                replicated_out = out[:, seq_len:]
                out = out[:, :seq_len]
                if world > 1:
                    replicated_out = _gather_heads(replicated_out, world, group)
        else:  # one rank (world > 1 took the pipelined path above)
            out = self._vsa(q, k, v, None if gate is None else gate[:, :seq_len])

        if seq_len != padded:
            out = F.pad(out, (0, 0, 0, 0, 0, padded - seq_len))
        if world > 1:
            out = _heads_to_sequence(out, world, group)
        return out if replicated is None else (out, replicated_out)

    def _head_ranges(self, sharded, world: int) -> List[tuple]:
        """This rank's q heads split into the VSA pipeline's chunks, ``[(h0, h1), ...]``.
        Every tensor's heads must split at the same places (grouped k / v heads)."""
        h_local = sharded[0].shape[2] // world
        spec = self.head_chunks
        if spec is None:  # 2 equal chunks where they split every tensor's heads, else 1
            sizes = [h_local // 2] * 2 if h_local % 2 == 0 else [h_local]
            if not self._ranges_fit(sizes, sharded, world):
                sizes = [h_local]
        elif isinstance(spec, int):
            if h_local % spec != 0:
                raise ValueError(f"DistributedAttention: head_chunks={spec} must divide the "
                                 f"{h_local} heads per rank")
            sizes = [h_local // spec] * spec
        else:
            sizes = list(spec)
            if sum(sizes) != h_local:
                raise ValueError(f"DistributedAttention: head_chunks={list(spec)} must sum to the "
                                 f"{h_local} heads per rank")
        if not self._ranges_fit(sizes, sharded, world):
            raise ValueError(f"DistributedAttention: head_chunks={spec} must split every "
                             f"tensor's heads per rank evenly, got "
                             f"{[x.shape[2] // world for x in sharded]}")
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        return list(zip(bounds[:-1], bounds[1:]))

    @staticmethod
    def _ranges_fit(sizes, sharded, world: int) -> bool:
        """Whether every chunk edge (in q heads) is also a whole number of each tensor's heads."""
        h_local = sharded[0].shape[2] // world
        edge = 0
        for size in sizes:
            edge += size
            if any(edge * (x.shape[2] // world) % h_local for x in sharded):
                return False
        return True

    def _vsa_pipelined(self, sharded, world: int, group, seq_len: int, padded: int, cos, sin,
                       ranges):
        """The VSA path (world > 1) over the head chunks `ranges` of this rank's heads, with
        the all-to-alls overlapping compute: chunk c + 1 travels while chunk c computes, and
        chunk c's fine output travels back while chunk c + 1 computes. Head j * h_local + h
        of a tensor is head h of the chunk list on rank j. sharded: q, k, v. Returns this
        rank's rows of the fine output ``[B, S_local, H, Dv]`` and the coarse output of all
        heads ``[B, Tiles, H, Dv]`` (float32), for the combination on this rank."""
        b, s_local = sharded[0].shape[0], sharded[0].shape[1]
        if b == 1:
            return self._vsa_pipelined_b1(sharded, world, group, seq_len, padded, cos, sin,
                                          ranges)
        h_local = sharded[0].shape[2] // world
        # Every chunk's all-to-all is issued up front: NCCL runs them in order while the
        # compute stream works on the chunks already received. The packing, unpacking and
        # placing copies go through _copy_rows (16-byte words where autograd is off).
        pending, widths = [], []
        for h0, h1 in ranges:
            parts = [_head_slice(x, world, h_local, h0, h1).permute(2, 0, 1, 3, 4).flatten(-2)
                     for x in sharded]  # [world (destination), B, S_local, hc * D]
            widths.append([part.shape[-1] for part in parts])
            send = parts[0].new_empty(world, b, s_local, sum(widths[-1]))
            offset = 0
            for part in parts:  # (slices, not split: autograd lets slices be written)
                _copy_rows(send[..., offset:offset + part.shape[-1]], part)
                offset += part.shape[-1]
            pending.append(_all_to_all_start(send, world, group))
        returning, gathered = [], []
        for c in range(len(ranges)):
            recv = torch.ops._c10d_functional.wait_tensor(pending[c])
            full = _copy_rows(recv.new_empty(b, world, s_local, recv.shape[-1]),
                              recv.permute(1, 0, 2, 3)).view(b, world * s_local, -1)
            q, k, v = [chunk.unflatten(-1, (-1, x.shape[3]))[:, :seq_len]
                       for chunk, x in zip(torch.split(full, widths[c], dim=-1), sharded)]
            if cos is not None:
                q = apply_rope(q, cos, sin, interleaved=self.interleaved_rope)
                k = apply_rope(k, cos, sin, interleaved=self.interleaved_rope)
            fine, coarse = self._vsa_chunk([q, k, v], lambda x: x, seq_len, padded, world,
                                           group)
            gathered.append(coarse)
            hc, dv = fine.shape[2], fine.shape[3]
            send = _copy_rows(fine.new_empty(world, b, s_local, hc * dv),
                              fine.reshape(b, world, s_local, hc * dv).permute(1, 0, 2, 3))
            returning.append(_all_to_all_start(send, world, group))
        # [world (head group), B, S_local, hc * Dv] per chunk -> [B, S_local, world, hc, Dv],
        # placed at the chunk's heads of every head group.
        fine = None
        for r, (h0, h1) in zip(returning, ranges):
            back = torch.ops._c10d_functional.wait_tensor(r).permute(1, 2, 0, 3)
            back = back.unflatten(-1, (h1 - h0, -1))
            if fine is None:
                fine = back.new_empty(b, s_local, world, h_local, back.shape[-1])
            _copy_rows(fine[:, :, :, h0:h1], back)
        fine = fine.view(b, s_local, world * h_local, fine.shape[-1])
        return fine, self._gathered_coarse(gathered, world)

    def _vsa_pipelined_b1(self, sharded, world: int, group, seq_len: int, padded: int, cos,
                          sin, ranges, gate=None, combine: bool = False):
        """_vsa_pipelined for B = 1 without the packing copy: the tensors of a chunk travel
        in separate all-to-alls, each sent from a [world, S_local, hc, D] buffer that one pass
        fills. RoPE runs before the all-to-all, on this rank's positions, and is that pass for
        q and k (a view of the shard with the destination rank as the batch dimension); v is
        copied. What arrives is already [1, world * S_local, hc, D].
        ``combine`` (no autograd): instead of placing each returned chunk into the fine
        output, combine it with its coarse output and the gate straight into its heads of the
        layer's output (``vsa_combine_rows_into``) and return that: the placing copies and
        the separate combination pass go, and the first chunk's combination runs while the
        last chunk's output is still travelling."""
        rank = dist.get_rank(group)
        s_local = sharded[0].shape[1]
        h_local = sharded[0].shape[2] // world
        tables = None
        if cos is not None:
            # This rank's rows of the tables; rows past seq_len (padding) rotate to 0.
            lo, hi = min(rank * s_local, seq_len), min((rank + 1) * s_local, seq_len)
            tables = [F.pad(t[lo:hi], (0, 0, 0, s_local - (hi - lo))) for t in (cos, sin)]

        def send_buffer(x, c, rotate):
            # [world (destination), S_local, hc, D]
            view = _head_slice(x, world, h_local, *ranges[c])[0].permute(1, 0, 2, 3)
            if rotate and tables is not None:
                return apply_rope(view, tables[0], tables[1], interleaved=self.interleaved_rope)
            return _copy_rows(torch.empty(view.shape, dtype=view.dtype, device=view.device),
                              view)

        def issue(c):  # chunk c's send buffers, then its all-to-alls (on NCCL's stream)
            return [_all_to_all_start(send_buffer(x, c, i < 2), world, group)
                    for i, x in enumerate(sharded)]

        def arrived(r):  # a chunk's tensor, [1, seq_len, hc, D], once its all-to-all is done
            t = torch.ops._c10d_functional.wait_tensor(r)
            return t.reshape(1, world * s_local, t.shape[2], t.shape[3])[:, :seq_len]

        def place(c, a, b, returned):
            """Heads a:b of chunk c (this rank's rows, back from every head group)."""
            back = torch.ops._c10d_functional.wait_tensor(returned)
            h0, h1 = ranges[c][0] + a, ranges[c][0] + b
            if not combine:
                _copy_rows(result[:, :, h0:h1], back.permute(1, 0, 2, 3))
                return
            # Head group j as the batch dimension: [world, S_local, heads, Dv] views of the
            # output and the gate, and of the all-gathered coarse output [world, Tiles, hc, Dv].
            coarse = torch.ops._c10d_functional.wait_tensor(gathered[c])[:, :, a:b]
            gate_c = None
            if gate is not None:
                gate_c = gate[0].unflatten(1, (world, h_local))[:, :, h0:h1].permute(1, 0, 2, 3)
            tiling = self.tiling
            torch.ops.vidattn.vsa_combine_rows_into(
                result[:, :, h0:h1].permute(1, 0, 2, 3), back, coarse, gate_c,
                tiling.token_to_slot, tiling.slot_to_token, tiling.tile_volume, rank * s_local)

        # Chunk c + 1 is packed and sent once chunk c's selection is queued: for chunk 0 that
        # is while its v is still in flight, so the packing delays neither chunk 0's
        # first stages nor (NCCL runs the all-to-alls in order) its inputs; chunk c + 1's
        # all-to-alls then run beside chunk c's fine attention.
        chunks = len(ranges)
        pending = {0: issue(0)}
        returning, gathered = [], []
        result = None

        def issue_next(c):
            if c + 1 < chunks:
                pending[c + 1] = issue(c + 1)

        def send(c, a, b, fine):  # heads a:b of chunk c go back to their home ranks
            nonlocal result
            if result is None:
                result = fine.new_empty(s_local, world, h_local, fine.shape[3])
            returning.append((c, a, b, _all_to_all_start(
                fine.view(world, s_local, b - a, fine.shape[3]), world, group)))

        for c in range(chunks):
            # Inference: the last chunk's heads in two pieces, so that the first piece's
            # return and combination run while the second computes, and only half a chunk's
            # return waits at the end (with autograd: one piece, the measured training path).
            pieces = _TAIL_PIECES if combine and c == chunks - 1 else 1
            _, coarse = self._vsa_chunk(pending.pop(c), arrived, seq_len, padded, world,
                                        group, before_v=lambda: issue_next(c),
                                        send=lambda a, b, fine: send(c, a, b, fine),
                                        pieces=pieces)
            gathered.append(coarse)
            # What came back while this chunk computed is placed now, so that only the last
            # piece's placement follows the last compute.
            while len(returning) > pieces:
                place(*returning.pop(0))
        while returning:
            place(*returning.pop(0))
        result = result.view(1, s_local, world * h_local, result.shape[-1])
        return result if combine else (result, self._gathered_coarse(gathered, world))


# Pieces of the last head chunk in the inference pipeline (see _vsa_pipelined_b1).
_TAIL_PIECES = 2


def _untracked(*tensors) -> bool:
    """Whether eager code may take shortcuts that autograd and compile would not see: not
    compiling, and autograd records none of the tensors (None entries allowed)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled()
                and any(t is not None and t.requires_grad for t in tensors))


def _copy_rows(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` (same shape and dtype, unit-stride last dimension), moved in 16-byte
    words where autograd is not recording: torch's copy between the strided head slices of
    the pipeline moves 2-byte elements with per-element index math (0.24-0.29 ms per 97 MB
    on an H200, ~0.7 TB/s), which sits on the critical path twice per chunk. Reinterpreted
    as complex128, the same bytes move as 16-byte elements. Views whose rows or offsets are
    not whole 16-byte words, tensors under autograd and compiled graphs take the plain
    copy."""
    def words(t):
        if (t.stride(-1) != 1 or (t.shape[-1] * t.element_size()) % 16
                or (t.storage_offset() * t.element_size()) % 16
                or any((st * t.element_size()) % 16 for st in t.stride()[:-1])):
            return None
        return t.view(torch.complex128)

    plain = dst.dtype != src.dtype or not _untracked(src, dst)
    if not plain:
        dst_words, src_words = words(dst), words(src)
        if dst_words is not None and src_words is not None:
            dst_words.copy_(src_words)
            return dst
    return dst.copy_(src)


def _head_slice(x: torch.Tensor, world: int, h_local: int, h0: int, h1: int) -> torch.Tensor:
    """[B, S_local, world, hc, D] view of x's heads of chunk [h0, h1) (counted in q heads,
    h_local per rank) in every rank's head group; grouped k / v heads scale the range."""
    x_local = x.shape[2] // world
    lo, hi = h0 * x_local // h_local, h1 * x_local // h_local
    return x.reshape(x.shape[0], x.shape[1], world, x_local, x.shape[3])[:, :, :, lo:hi]
