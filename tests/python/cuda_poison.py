"""NaN poisoning of the CUDA caching allocator, shared by the CUDA tests."""
import torch


def poison_allocator(nbytes: int) -> None:
    """Fill freed blocks of the caching allocator with NaN, so that the outputs an op
    allocates next start as NaN and any element a kernel forgets to write shows up. Four
    blocks, so that outputs of several sizes land on poisoned memory."""
    blocks = [torch.full((max(nbytes // 4, 1),), float("nan"), device="cuda") for _ in range(4)]
    del blocks
