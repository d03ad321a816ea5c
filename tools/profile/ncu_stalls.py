"""Reads `ncu --page raw --csv` on stdin and prints, per profiled kernel, the warp stall
reasons (average warps stalled per issued instruction, largest first) and a few pipe and
throughput metrics (and the DRAM traffic and L2 hit rate): what the details page sums into
one number."""
import csv
import sys

KEEP = ("smsp__average_warps_issue_stalled_", "sm__pipe_tensor_op_hmma_cycles_active",
        "sm__inst_executed_pipe_", "lts__t_sectors_srcunit_tex_op_read_lookup_hit",
        "l1tex__data_pipe_lsu_wavefronts_mem_shared", "smsp__inst_executed.sum",
        "gpu__time_duration.sum", "sm__throughput", "lts__throughput", "smsp__issue_active",
        "sm__pipe_")
# Printed whatever their unit: the DRAM traffic and the L2 hit rate (K / V reuse between CTAs).
TRAFFIC = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sector_hit_rate.pct")


def main() -> None:
    rows = list(csv.reader(sys.stdin))
    header = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    names, units = rows[header], rows[header + 1]
    for r in rows[header + 2:]:
        if len(r) != len(names):
            continue
        record = dict(zip(names, r))
        print("==", record.get("Kernel Name", "?")[:160])
        stalls = []
        for n, u, v in zip(names, units, r):
            if n.startswith("smsp__average_warps_issue_stalled_") and n.endswith("_per_issue_active.ratio"):
                try:
                    stalls.append((float(v.replace(",", "")), n))
                except ValueError:
                    pass
        for value, n in sorted(stalls, reverse=True)[:14]:
            short = n[len("smsp__average_warps_issue_stalled_"):-len("_per_issue_active.ratio")]
            print(f"   stall {short:28s} {value:8.3f}")
        for n, u, v in zip(names, units, r):
            if (any(n.startswith(k) for k in KEEP[1:]) and "pct" in n or n.startswith("gpu__time")
                    or n in TRAFFIC):
                print(f"   {n:70s} {v:>14s} {u}")


if __name__ == "__main__":
    main()
