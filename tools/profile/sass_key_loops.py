"""The key-block loops of each sm_90a attention kernel, from the SASS of one or more op
libraries (or cubins) side by side: a static check of a kernel change before any GPU run.

    python3 tools/profile/sass_key_loops.py old.so new.so [--filter 'bfloat16_t, 128, 64'] [--arch sm_90a]

For each kernel: its instruction count and local-memory accesses (LDL / STL: spills and
stack), then each innermost loop that issues wgmma (HGMMA), as
  instructions / HGMMA / divergence guards (BRA.DIV) / local accesses.
A key loop should have no local access, and no BRA.DIV: the compiler adds that guard around
warp-collective code when it cannot prove the warp converged (a loop bound read from shared
memory, say; docs/perf-notes.md). Needs cuobjdump and c++filt on PATH (the CUDA toolkit,
or the nvidia-cuda-cuobjdump wheel)."""
import argparse
import re
import sys

from sass_compare import sass_listings

INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
LOCAL = re.compile(r"\b(LDL|STL)\b")


def kernels(path, arch, pattern="sm90"):
    """{demangled name: [(address, instruction text)]} for the kernels whose demangled name
    matches ``pattern`` (by default every sm90 one: the attention kernels' names change with
    their namespaces and configurations, the sm90 in them does not)."""
    found = {}
    for _, name, lines in sass_listings(path, arch):
        if re.search(pattern, name):
            found[name] = [(int(m.group(1), 16), m.group(2))
                           for m in map(INSTR.match, lines) if m]
    return found


def key_loops(instrs):
    """The innermost loops (backward branches) whose bodies issue HGMMA: one tuple each of
    (instructions, HGMMA, BRA.DIV, local accesses), in address order."""
    index = {addr: i for i, (addr, _) in enumerate(instrs)}
    spans = []
    for i, (addr, text) in enumerate(instrs):
        m = BRANCH_TARGET.search(text)
        if m and "BRA.DIV" not in text:
            target = int(m.group(1), 16)
            # A jump back from the slow paths placed after the kernel's exits (an mbarrier
            # wait's retry, say) spans an EXIT: not a loop.
            if target < addr and target in index and not any(
                    t.split()[-1] == "EXIT" for _, t in instrs[index[target]:i]):
                spans.append((index[target], i))
    loops = []
    for lo, hi in spans:
        # Innermost: no other HGMMA loop lies strictly inside this one.
        if any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans
               if any("HGMMA" in t for _, t in instrs[a:b + 1])):
            continue
        body = [t for _, t in instrs[lo:hi + 1]]
        hgmma = sum("HGMMA" in t for t in body)
        if hgmma:
            loops.append((len(body), hgmma, sum("BRA.DIV" in t for t in body),
                          sum(bool(LOCAL.search(t)) for t in body)))
    return sorted(set(loops), key=loops.index)


def short_name(name):
    m = re.search(r"FwdTraits<([^>]*)>, vidattn::cuda_sm90::(\w+<[^>]*>)", name)
    return f"{m.group(1)} | {m.group(2)}" if m else name[:160]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("libs", nargs="+")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--filter", default="", help="regex on the demangled kernel name")
    ap.add_argument("--kernels", default="sm90",
                    help="regex: which kernels are read at all (default: sm90 ones)")
    args = ap.parse_args()
    libs = [kernels(path, args.arch, args.kernels) for path in args.libs]
    for name in libs[0]:
        if args.filter and not re.search(args.filter, name):
            continue
        print(short_name(name))
        for path, lib in zip(args.libs, libs):
            if name not in lib:
                print(f"  {path}: absent")
                continue
            instrs = lib[name]
            local = sum(bool(LOCAL.search(t)) for _, t in instrs)
            loops = "  ".join(f"{n}/{h}/{d}/{l}" for n, h, d, l in key_loops(instrs))
            print(f"  {path}: {len(instrs)} instructions, {local} local; key loops "
                  f"(instr/HGMMA/BRA.DIV/local): {loops}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
