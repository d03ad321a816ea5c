"""Where a kernel's warps wait, from Nsight Compute's per-instruction source counters.

    ncu --profile-from-start off --set full --import-source yes -o rep python3 tools/profile/profile_sm90.py ...
    ncu --import rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 tools/profile/ncu_stall_breakdown.py sass.csv [--kernel SUBSTRING] [--top 30]

Prints, for one kernel of the export: the stall reasons summed over the kernel; the samples
grouped by how often each instruction ran (instructions that run once per tile per warp,
once per key block, once per producer iteration fall into separate groups, so the groups
separate a kernel's phases without reading its SASS); and the instructions with the most
samples, with their top reasons. Not a benchmark: it reads a profile.
"""
import argparse
import collections
import csv
import gzip
import sys


def read_kernel_blocks(path):
    """[(kernel name, header, rows)] from the source page's CSV, one block per profiled launch
    in the export's order (a kernel launched twice has two blocks)."""
    opener = gzip.open if path.endswith(".gz") else open
    blocks = []
    with opener(path, "rt", newline="") as f:
        for rec in csv.reader(f):
            if not rec:
                continue
            if rec[0] == "Kernel Name":
                blocks.append((rec[1], None, []))
            elif blocks[-1][1] is None:
                blocks[-1] = (blocks[-1][0], rec, blocks[-1][2])
            else:
                blocks[-1][2].append(rec)
    return blocks


def read_kernels(path):
    """{kernel name: (header, rows)} from the source page's CSV (a kernel launched twice: its
    last block)."""
    return {name: (header, rows) for name, header, rows in read_kernel_blocks(path)}


def as_int(text):
    try:
        return int(text)
    except ValueError:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.gz too)")
    ap.add_argument("--kernel", default="", help="a substring of the kernel's name")
    ap.add_argument("--top", type=int, default=30, help="instructions to list")
    args = ap.parse_args()
    kernels = {k: v for k, v in read_kernels(args.csv).items() if args.kernel in k}
    if not kernels:
        sys.exit(f"no kernel matching {args.kernel!r} in {args.csv}")
    for name, (header, rows) in kernels.items():
        col = {h: i for i, h in enumerate(header)}
        samples = col["Warp Stall Sampling (All Samples)"]
        executed = col["Instructions Executed"]
        source = col["Source"]
        reasons = [i for i, h in enumerate(header)
                   if h.startswith("stall_") and "Not Issued" not in h]
        total = sum(as_int(r[samples]) for r in rows)
        print(f"== {name[:160]}\n{len(rows)} instructions, {total} samples")
        by_reason = collections.Counter()
        for r in rows:
            for i in reasons:
                by_reason[header[i][len("stall_"):]] += as_int(r[i])
        print("reasons:", ", ".join(f"{k} {v}" for k, v in by_reason.most_common(10)))
        groups = collections.defaultdict(lambda: [0, 0])
        for r in rows:
            g = groups[as_int(r[executed])]
            g[0] += as_int(r[samples])
            g[1] += 1
        print("by execution count (count: samples, share, instructions):")
        for count, (s, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:10]:
            print(f"  {count:>10}: {s:>7} {100.0 * s / max(total, 1):5.1f}%  {n} instr")
        print(f"top {args.top} instructions (index, samples, executed, source, reasons):")
        top = sorted(range(len(rows)), key=lambda k: -as_int(rows[k][samples]))[:args.top]
        for k in sorted(top):
            r = rows[k]
            why = sorted(((as_int(r[i]), header[i][len("stall_"):]) for i in reasons),
                         reverse=True)[:3]
            print(f"  {k:>6} {r[samples]:>6} {r[executed]:>8}  {r[source].strip()[:56]:<56} "
                  + ", ".join(f"{w} {c}" for c, w in why if c))


if __name__ == "__main__":
    main()
