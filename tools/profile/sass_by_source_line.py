"""Which source lines a kernel's executed instructions come from: Nsight Compute's per-SASS
counts joined to the line table nvdisasm reads from the same library (built with -lineinfo).

    ncu --profile-from-start off --set full --import-source yes -o rep python3 tools/profile/profile_vs_cudnn.py ...
    ncu --import rep.ncu-rep --page source --csv --print-source sass | gzip > sass.csv.gz
    cuobjdump -xelf all _vidattn_ops.so                # one cubin per translation unit
    nvdisasm -c -gi sm90_fwd_bf16_hd128_dense.sm_90a.cubin > dense128.sass
    python3 tools/profile/sass_by_source_line.py sass.csv.gz dense128.sass --kernel 0 --units 6142.5

Prints, for the kernel at position --kernel of the export (its SASS found in the disassembly
by name), the warp instructions executed and the share of warp stall samples per source line
of src/ (the innermost --depth frames of the inlining chain), with the opcodes that make
them up; --units divides the counts (e.g. the number of 64-row query tiles, for a count per
tile). A kernel of another library (cuDNN's) has no line table: --opcodes prints its opcode
mix instead, which needs no disassembly (pass "-" for it). Not a benchmark: it reads a
profile.
"""
import argparse
import collections
import re
import subprocess
import sys

from ncu_stall_breakdown import as_int, read_kernel_blocks


def normalise(name):
    """A demangled kernel name as ncu and c++filt both can be brought to write it."""
    name = name.replace("(bool)0", "false").replace("(bool)1", "true")
    name = re.sub(r"\((?:int|unsigned int|long)\)", "", name)
    name = name[: name.rfind("(")] if name.endswith(")") else name  # drop the parameter list
    return re.sub(r"\s+", "", name)


def line_table(disasm_path, kernel_name):
    """{SASS offset: (inlining chain [(file, line)], instruction)} of the kernel's section."""
    text = open(disasm_path).read().splitlines()
    sections = [(i, l[len(".text."):].rstrip(":")) for i, l in enumerate(text)
                if l.startswith(".text.") and l.endswith(":")]
    demangled = subprocess.run(["c++filt"], input="\n".join(n for _, n in sections),
                               capture_output=True, text=True, check=True).stdout.splitlines()
    want = normalise(kernel_name)
    starts = [i for (i, _), d in zip(sections, demangled) if normalise(d) == want]
    if len(starts) != 1:
        sys.exit(f"kernel not found once in {disasm_path} ({len(starts)} matches): {kernel_name}")
    begin = starts[0]
    end = min([i for i, _ in sections if i > begin], default=len(text))
    table, chain, fresh = {}, [], True
    for line in text[begin:end]:
        stripped = line.strip()
        if stripped.startswith("//##"):
            # One comment line per inlining level, innermost first.
            if fresh:
                chain, fresh = [], False
            chain.append(re.findall(r'"([^"]+)", line (\d+)', stripped)[0])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            table[int(m.group(1), 16)] = (chain, m.group(2))
            fresh = True
    return table


def opcode(instruction):
    instruction = re.sub(r"^@!?U?P\w+\s+", "", instruction.strip())
    return instruction.split()[0].split(".")[0] if instruction else "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass (optionally .gz)")
    ap.add_argument("disasm", help="nvdisasm -c -gi of the cubin holding the kernel, or -")
    ap.add_argument("--kernel", type=int, default=0, help="position of the kernel in the export")
    ap.add_argument("--units", type=float, default=1.0, help="divide the counts by this")
    ap.add_argument("--depth", type=int, default=1, help="inlining frames of src/ per key")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--opcodes", action="store_true", help="the opcode mix only")
    args = ap.parse_args()

    name, header, rows = read_kernel_blocks(args.csv)[args.kernel]
    col = {k: header.index(k) for k in ("Address", "Source", "Instructions Executed",
                                        "Warp Stall Sampling (All Samples)")}
    executed = [as_int(r[col["Instructions Executed"]]) for r in rows]
    samples = [as_int(r[col["Warp Stall Sampling (All Samples)"]]) for r in rows]
    total_samples = max(1, sum(samples))
    print(f"{name[:160]}\n{sum(executed) / args.units:.0f} warp instructions per unit, "
          f"{len(rows)} SASS instructions")
    if args.opcodes:
        count, stall = collections.Counter(), collections.Counter()
        for r, n, s in zip(rows, executed, samples):
            count[opcode(r[col["Source"]])] += n
            stall[opcode(r[col["Source"]])] += s
        for op, n in count.most_common(args.top):
            print(f"{n / args.units:10.1f} {100 * stall[op] / total_samples:5.1f}%  {op}")
        return

    table = line_table(args.disasm, name)
    base = int(rows[0][col["Address"]], 16)
    count, stall = collections.Counter(), collections.Counter()
    ops = collections.defaultdict(collections.Counter)
    for r, n, s in zip(rows, executed, samples):
        chain, instruction = table.get(int(r[col["Address"]], 16) - base, ([], "?"))
        if opcode(instruction) != opcode(r[col["Source"]]):
            sys.exit(f"the disassembly is not of the profiled library (at {r[col['Address']]})")
        ours = [f"{f.split('/')[-1]}:{line}" for f, line in chain if "/src/" in f]
        key = " < ".join(ours[: args.depth]) if ours else (
            f"{chain[0][0].split('/')[-1]}:{chain[0][1]}" if chain else "?")
        count[key] += n
        stall[key] += s
        ops[key][opcode(r[col["Source"]])] += n
    for key, n in count.most_common(args.top):
        mix = " ".join(f"{o}:{c / args.units:.0f}" for o, c in ops[key].most_common(5))
        print(f"{n / args.units:10.1f} {100 * stall[key] / total_samples:5.1f}%  {key[:80]}  | {mix}")


if __name__ == "__main__":
    main()
