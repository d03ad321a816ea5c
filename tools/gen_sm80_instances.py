"""Writes the instantiation files of the sm_80 attention kernels (src/cuda/sm80/*.cu): one
explicit instantiation per (direction, dtype, head dim, variant), so that nvcc compiles them in
parallel. Run after changing the list; the files are committed."""
from pathlib import Path

DIR = Path(__file__).resolve().parent.parent / "src" / "cuda" / "sm80"
DTYPES = {"bf16": "__nv_bfloat16", "fp16": "__half"}
HEAD_DIMS = (64, 128)

TEMPLATE = """// {what} instantiation: {dt}, head dim {d}{extra}.
#include "launch_impl.h"

namespace vidattn::cuda_sm80 {{
template void {fn}<{args}>(const AttentionParams&, cudaStream_t);
}}  // namespace vidattn::cuda_sm80
"""


def files():
    for dt, ctype in DTYPES.items():
        for d in HEAD_DIMS:
            yield f"fwd_{dt}_hd{d}.cu", dict(what="Forward", fn="launch_forward",
                                            args=f"{ctype}, {d}", extra="")
            yield f"bwd_{dt}_hd{d}.cu", dict(what="Backward", fn="launch_backward",
                                            args=f"{ctype}, {d}", extra="")
            for bq in (64, 128):
                yield f"sparse_fwd_{dt}_hd{d}_bq{bq}.cu", dict(
                    what="Block-sparse forward", fn="launch_block_sparse_forward",
                    args=f"{ctype}, {d}, {bq}", extra=f", {bq}-row query blocks")
            yield f"sparse_bwd_{dt}_hd{d}.cu", dict(
                what="Block-sparse backward", fn="launch_block_sparse_backward",
                args=f"{ctype}, {d}", extra="")


def main():
    for name, fields in files():
        dt, d = name.split("_hd")[0].split("_")[-1], name.split("_hd")[1].split("_")[0].split(".")[0]
        (DIR / name).write_text(TEMPLATE.format(dt=dt, d=d, **fields))


if __name__ == "__main__":
    main()
