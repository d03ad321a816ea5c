"""Dense attention: vidattn.attention against PyTorch SDPA (pinned backends on CUDA)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import reference
from .base import Case, Impl, QkvInputs, missing_vidattn_op
from .reference import RefScope
from .shapes import Shape


@dataclass(frozen=True)
class DenseInputs(QkvInputs):
    q: torch.Tensor  # [B, Sq, H, D]
    k: torch.Tensor  # [B, Sk, H, D]
    v: torch.Tensor  # [B, Sk, H, D]
    causal: bool
    scale: Optional[float] = None



class VidattnDense(Impl):
    """vidattn.attention; ``deterministic=False`` is the row "vidattn-nondet" (the backward's
    option: on Hopper one fused kernel that adds dQ in a varying order)."""

    backend, is_ours = "vidattn.attention", True

    def __init__(self, deterministic: bool = True):
        self.deterministic = deterministic
        self.name = "vidattn" if deterministic else "vidattn-nondet"

    def unavailable_reason(self, device):
        return missing_vidattn_op("attention")

    def forward(self, inputs: DenseInputs) -> torch.Tensor:
        import vidattn  # the bench is part of the package; imported late to keep the cli light

        return vidattn.attention(inputs.q, inputs.k, inputs.v, scale=inputs.scale,
                                 causal=inputs.causal, deterministic=self.deterministic)


class SdpaDense(Impl):
    """PyTorch SDPA on ``[B, H, S, D]`` transposed views (no copies), optionally pinned to one
    backend with ``sdpa_kernel``."""

    _LOW_PRECISION_ONLY = ("FLASH_ATTENTION", "CUDNN_ATTENTION")

    def __init__(self, backend: Optional[str] = None):
        self.sdpa_backend = backend
        self.name = "sdpa" if backend is None else "sdpa-" + {
            "FLASH_ATTENTION": "flash", "CUDNN_ATTENTION": "cudnn",
            "EFFICIENT_ATTENTION": "efficient", "MATH": "math"}[backend]
        self.backend = "torch SDPA " + ("(default dispatch)" if backend is None else backend)

    def skip_reason(self, device, dtype, shape):
        if self.sdpa_backend is not None and device.type != "cuda":
            return f"{self.name}: CUDA only"
        if self.sdpa_backend in self._LOW_PRECISION_ONLY and dtype not in (torch.float16,
                                                                           torch.bfloat16):
            return f"{self.name}: needs fp16/bf16"
        return None

    def forward(self, inputs: DenseInputs) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))
        kwargs = {"scale": inputs.scale}
        if inputs.causal and q.shape[-2] == k.shape[-2]:
            kwargs["is_causal"] = True
        elif inputs.causal:  # SDPA's is_causal is top-left aligned; vidattn's is bottom-right
            from torch.nn.attention.bias import causal_lower_right

            kwargs["attn_mask"] = causal_lower_right(q.shape[-2], k.shape[-2])
        if self.sdpa_backend is None:
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(getattr(SDPBackend, self.sdpa_backend)):
                out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return out.transpose(1, 2)


class DenseCase(Case):
    name = "dense"

    def forward_flops(self, shape: Shape) -> float:
        flops = 4.0 * shape.batch * shape.heads * shape.q_len * shape.kv_len * shape.head_dim
        return flops / 2 if shape.causal else flops

    def make_inputs(self, shape, dtype, device, generator, input_scale=1.0) -> DenseInputs:
        def randn(seq):
            t = torch.randn(shape.batch, seq, shape.heads, shape.head_dim, device=device,
                            generator=generator, dtype=torch.float32)
            return (t * input_scale).to(dtype)

        return DenseInputs(randn(shape.q_len), randn(shape.kv_len), randn(shape.kv_len),
                           shape.causal)

    def make_grad_out(self, inputs: DenseInputs, generator) -> torch.Tensor:
        q = inputs.q  # the output has q's shape here (Dv == D)
        return torch.randn(q.shape, device=q.device, generator=generator,
                           dtype=torch.float32).to(q.dtype)

    def reference_forward(self, inputs: DenseInputs, scope: RefScope, kind: str = ""):
        out, _ = reference.attention_forward(
            scope.take(inputs.q), scope.take(inputs.k), scope.take(inputs.v),
            scale=inputs.scale, causal=inputs.causal)
        return (out,)

    def reference_backward(self, inputs: DenseInputs, grad_out, scope: RefScope, kind: str = ""):
        return reference.attention_backward(
            scope.take(inputs.q), scope.take(inputs.k), scope.take(inputs.v),
            scope.take(grad_out), scale=inputs.scale, causal=inputs.causal)


def dense_case(device: torch.device) -> DenseCase:
    if device.type == "cuda":
        # cuDNN is the peer the targets are set against; FA2 and the default dispatch for context.
        return DenseCase([VidattnDense(), VidattnDense(deterministic=False),
                          SdpaDense("CUDNN_ATTENTION"),
                          SdpaDense("FLASH_ATTENTION"), SdpaDense()],
                         peer_order=("sdpa-cudnn", "sdpa-flash", "sdpa"))
    return DenseCase([VidattnDense(), SdpaDense()], peer_order=("sdpa",))
