"""All-to-all over the GPUs' copy engines (torch symmetric memory), for DistributedAttention.

Why: NCCL's all-to-all kernels run on SMs. Beside the attention kernels, which fill every SM,
an overlapped NCCL transfer still costs about half of its own duration in lost compute
(tools/bench_alltoall.py; docs/perf-notes.md), so hiding the transfers behind compute hides
only half of them. Copies between GPUs that map each other's memory run on the copy engines
instead and take no SM.

How: every rank writes what it sends ([world, ...], slice j for rank j) into its own buffer
in symmetric memory; after a barrier, each rank pulls slice `rank` of every rank's buffer
into its output (cudaMemcpyAsync: copy engines, over NVLink for a peer), and a second
barrier tells the owners their buffers may be written again. The pulls run on a side stream;
the caller's stream waits for them only where it reads the output.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist


class PeerExchange:
    """Copy-engine all-to-alls among the ranks of one NCCL group on one node. One buffer in
    symmetric memory per `key` (shape and dtype fixed per key; made at first use, which is a
    collective: every rank must use the keys in the same order)."""

    def __init__(self, group):
        from torch.distributed import _symmetric_memory as symm_mem
        self._symm_mem = symm_mem
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        symm_mem.enable_symm_mem_for_group(group.group_name)
        self._buffers: Dict[object, list] = {}
        self._stream: Optional[torch.cuda.Stream] = None

    def _buffer(self, key, shape: Tuple[int, ...], dtype, device) -> list:
        entry = self._buffers.get(key)
        if entry is None or entry[0].shape != shape or entry[0].dtype != dtype:
            buf = self._symm_mem.empty(shape, dtype=dtype, device=device)
            handle = self._symm_mem.rendezvous(buf, self.group.group_name)
            entry = [buf, handle, None]  # buffer, handle, event: free to write again
            self._buffers[key] = entry
        return entry

    def start(self, key, shape: Tuple[int, ...], dtype, device,
              fill: Callable[[torch.Tensor], None]) -> Tuple[torch.Tensor, torch.cuda.Event]:
        """Issues one all-to-all along dim 0 of a [world, ...] tensor. `fill(buf)` writes the
        data to send into buf (on the current stream; slice j goes to rank j). Returns the
        output [world, ...] (slice j came from rank j) and the event after which it is
        complete: pass both to `wait`."""
        buf, handle, free = entry = self._buffer(key, tuple(shape), dtype, device)
        current = torch.cuda.current_stream(device)
        if free is not None:  # the previous exchange through this buffer is done everywhere
            current.wait_event(free)
        fill(buf)
        out = torch.empty(shape, dtype=dtype, device=device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        side = self._stream
        side.wait_stream(current)
        with torch.cuda.stream(side):
            handle.barrier(channel=0)  # every rank's buffer holds its data
            for step in range(self.world):
                src = (self.rank + step) % self.world
                remote = buf if src == self.rank else handle.get_buffer(src, tuple(shape), dtype)
                out[src].copy_(remote[self.rank])  # contiguous, same dtype: cudaMemcpyAsync
            handle.barrier(channel=0)  # every rank has pulled its slice of this buffer
            done = torch.cuda.Event()
            done.record(side)
        out.record_stream(side)
        entry[2] = done
        return out, done

    @staticmethod
    def wait(out: torch.Tensor, done: torch.cuda.Event) -> torch.Tensor:
        torch.cuda.current_stream(out.device).wait_event(done)
        return out


_EXCHANGES: Dict[str, PeerExchange] = {}


def peer_exchange(group) -> Optional[PeerExchange]:
    """The PeerExchange of `group`, or None where symmetric memory is not available (no
    CUDA, a backend other than NCCL, or the rendezvous failed)."""
    name = group.group_name
    if name not in _EXCHANGES:
        exchange = None
        try:
            if torch.cuda.is_available() and dist.get_backend(group) == "nccl":
                exchange = PeerExchange(group)
        except (RuntimeError, ImportError, AttributeError):
            exchange = None
        _EXCHANGES[name] = exchange
    return _EXCHANGES[name]


class _Exchange(torch.autograd.Function):
    """Differentiable start of a copy-engine all-to-all of x [world, ...]: returns the output
    still in flight (pass it through _Arrived before reading it). The gradient is the same
    all-to-all of the output's gradient (an all-to-all along dim 0 is its own transpose)."""

    @staticmethod
    def forward(ctx, x, exchange, key, holder):
        ctx.exchange, ctx.key = exchange, key
        out, done = exchange.start(key, tuple(x.shape), x.dtype, x.device,
                                   lambda buf: buf.copy_(x))
        holder.append(done)
        return out

    @staticmethod
    def backward(ctx, grad):
        g, done = ctx.exchange.start(("grad",) + tuple(ctx.key), tuple(grad.shape), grad.dtype,
                                     grad.device, lambda buf: buf.copy_(grad))
        return PeerExchange.wait(g, done), None, None, None


class _Arrived(torch.autograd.Function):
    """Identity that makes the current stream wait for an exchange's output."""

    @staticmethod
    def forward(ctx, out, done):
        return PeerExchange.wait(out, done).view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def exchange_start(exchange: PeerExchange, key, x: torch.Tensor):
    """Issues the all-to-all of x [world, ...] (any strides; copied into the send buffer).
    Returns a handle for exchange_wait."""
    holder: list = []
    out = _Exchange.apply(x, exchange, key, holder)
    return out, holder[0]


def exchange_wait(handle) -> torch.Tensor:
    out, done = handle
    return _Arrived.apply(out, done)
