"""Which kernels of two op libraries differ in their SASS, function by function: how the
perf notes check that a source change left kernels "SASS-identical" (and so needs no GPU
run for them).

    python3 tools/sass_compare.py build/.../_vidattn_ops.so baseline/_vidattn_ops.so [--arch sm_90a]

Needs cuobjdump (CUDA toolkit, or the nvidia-cuda-cuobjdump wheel) and c++filt on PATH.
Compares each function's disassembly (its own name taken out: branch targets are offsets
within the function); lists the functions that differ and those only one library has. Exits
1 when any differ or are missing."""
import argparse
import hashlib
import re
import subprocess
import sys


def sass_listings(path, arch):
    """[(mangled name, demangled name, its non-empty SASS lines)] for each function of the
    library or cubin (cuobjdump -sass, c++filt)."""
    out = subprocess.run(["cuobjdump", "-sass", "-arch", arch, path], capture_output=True,
                         text=True, check=True).stdout
    bodies, name = {}, None
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            bodies[name] = []
        elif name is not None and line.strip():
            bodies[name].append(line)
    mangled = list(bodies)
    demangled = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True,
                               text=True, check=True).stdout.splitlines()
    return [(m, d, bodies[m]) for m, d in zip(mangled, demangled)]


def functions(path, arch):
    """{demangled name: digest of its SASS}."""
    digests = {}
    for mangled, demangled, lines in sass_listings(path, arch):
        text = "\n".join(re.sub(r"\s+", " ", line.replace(mangled, "NAME")).strip()
                         for line in lines)
        digests[demangled] = hashlib.sha1(text.encode()).hexdigest()
    return digests


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--arch", default="sm_90a")
    args = ap.parse_args()
    a, b = functions(args.a, args.arch), functions(args.b, args.arch)
    same = [n for n in a if n in b and a[n] == b[n]]
    differ = [n for n in a if n in b and a[n] != b[n]]
    print(f"{len(same)} identical, {len(differ)} differ, {len(set(a) - set(b))} only in "
          f"{args.a}, {len(set(b) - set(a))} only in {args.b}")
    for n in differ:
        print("differs:", n[:200])
    for n in sorted(set(a) ^ set(b)):
        print("only in", args.a if n in a else args.b, ":", n[:200])
    return 1 if differ or set(a) ^ set(b) else 0


if __name__ == "__main__":
    sys.exit(main())
