from __future__ import annotations

import torch

_ops = torch.ops.vidattn


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               interleaved: bool = True) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[B, S, H, D]`` (any strides, unit stride on D,
    D even), out of place; returns a new contiguous tensor of x's dtype. Math in float32
    (float64 for float64 x).

    Pairs: ``interleaved=True`` rotates (2i, 2i+1) (GPT-J / original LLaMA layout);
    ``interleaved=False`` rotates (i, i + D/2) (GPT-NeoX "rotate half" layout).

    ``cos`` and ``sin`` (same shape and float dtype, x's device, any strides):

    - ``[S, D/2]``: pair i at position s is rotated by the angle whose cosine and sine are
      ``cos[s, i]``, ``sin[s, i]``.
    - ``[S, D]``: each element j uses its own ``cos[s, j]``, ``sin[s, j]``, i.e. the usual
      ``x * cos + rotate(x) * sin`` with ``rotate`` mapping a pair (a, b) to (-b, a). Full-width
      tables repeat each angle: ``cat([f, f], -1)`` for NeoX halves,
      ``repeat_interleave(f, 2, -1)`` for interleaved pairs.

    Autograd: the gradient flows to ``x`` only (the transposed map: the rotation by minus the
    angle). ``cos`` and ``sin`` are treated as constant tables: no gradient flows to them,
    even if they require grad.
    """
    return _ops.apply_rope(x, cos, sin, interleaved=bool(interleaved))
