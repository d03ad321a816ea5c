"""Which kernels of two op libraries differ in their SASS: how a source change is shown to
leave kernels "SASS-identical" (and so to need no GPU run for them).

    python3 tools/profile/sass_compare.py A/_vidattn_ops.so B/_vidattn_ops.so [--arch sm_90a]
    python3 tools/profile/sass_compare.py A.so B.so --by-body [--pairs]

Needs cuobjdump (CUDA toolkit, or the nvidia-cuda-cuobjdump wheel) and c++filt on PATH.
Each function's disassembly is reduced to its instructions and their encodings (its own name
taken out: branch targets are offsets within the function) and hashed.

By name (the default): functions are matched by demangled name; lists those whose SASS
differs and those only one library has. Exits 1 when any differ or are missing.

--by-body: names are ignored, so a change that renames kernels (a namespace, a template
parameter, a file) can be checked: the two libraries' multisets of bodies are compared (other
functions' names inside a body, such as a call's target, are taken out too). Prints how many
of A's bodies have an identical body in B and the reverse, and the functions whose body has
no match on the other side; --pairs also prints, for each body whose function names differ,
A's name -> B's. Exits 1 unless every body of A has an identical body in B, as many times.
"""
import argparse
import collections
import hashlib
import re
import subprocess
import sys

# An instruction line (/*0a30*/ ...) or its encoding (/* 0x000fe2... */); the rest of
# cuobjdump's output (fatbin headers, the source file it names, .headerflags) is not the body.
BODY_LINE = re.compile(r"\s*/\*")
MANGLED = re.compile(r"\b_Z\w+")


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


def body_digest(mangled, lines, anonymous=False):
    """SHA-1 of a function's instructions, whitespace normalised, its own name replaced;
    ``anonymous`` replaces every other mangled name as well."""
    text = []
    for line in lines:
        if not BODY_LINE.match(line):
            continue
        line = line.replace(mangled, "NAME")
        if anonymous:
            line = MANGLED.sub("SYM", line)
        text.append(re.sub(r"\s+", " ", line).strip())
    return hashlib.sha1("\n".join(text).encode()).hexdigest()


def functions(path, arch, anonymous=False):
    """[(demangled name, digest of its SASS)] in the library's order."""
    return [(demangled, body_digest(mangled, lines, anonymous))
            for mangled, demangled, lines in sass_listings(path, arch)]


def compare_by_name(a, b, name_a="A", name_b="B"):
    """(report lines, whether every function is in both and identical) for two lists of
    (name, digest)."""
    a, b = dict(a), dict(b)
    same = [n for n in a if n in b and a[n] == b[n]]
    differ = [n for n in a if n in b and a[n] != b[n]]
    lines = [f"{len(same)} identical, {len(differ)} differ, {len(set(a) - set(b))} only in "
             f"{name_a}, {len(set(b) - set(a))} only in {name_b}"]
    lines += [f"differs: {n[:200]}" for n in differ]
    lines += [f"only in {name_a if n in a else name_b} : {n[:200]}"
              for n in sorted(set(a) ^ set(b))]
    return lines, not differ and not set(a) ^ set(b)


def compare_by_body(a, b, name_a="A", name_b="B", pairs=False):
    """(report lines, whether the two multisets of bodies are equal) for two lists of
    (name, digest): each body of A is matched with one identical body of B, names ignored."""
    left = collections.defaultdict(list)
    right = collections.defaultdict(list)
    for name, digest in a:
        left[digest].append(name)
    for name, digest in b:
        right[digest].append(name)
    matched = sum(min(len(left[d]), len(right.get(d, []))) for d in left)
    lines = [f"{name_a}: {len(a)} functions, {len(left)} distinct bodies; "
             f"{name_b}: {len(b)} functions, {len(right)} distinct bodies",
             f"{matched} of {name_a}'s {len(a)} bodies have an identical body in {name_b}; "
             f"{matched} of {name_b}'s {len(b)} in {name_a}"]
    for side, mine, theirs in ((name_a, left, right), (name_b, right, left)):
        for digest, names in mine.items():
            for name in names[len(theirs.get(digest, [])):]:
                lines.append(f"no identical body in the other library: {side}: {name[:200]}")
    if pairs:
        for digest, names in left.items():
            for x, y in zip(names, right.get(digest, [])):
                if x != y:
                    lines.append(f"renamed: {x[:160]} -> {y[:160]}")
    return lines, matched == len(a) == len(b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--by-body", action="store_true",
                    help="compare the multisets of function bodies, names ignored")
    ap.add_argument("--pairs", action="store_true",
                    help="with --by-body: print A's name -> B's for each renamed body")
    args = ap.parse_args()
    a = functions(args.a, args.arch, anonymous=args.by_body)
    b = functions(args.b, args.arch, anonymous=args.by_body)
    if args.by_body:
        lines, ok = compare_by_body(a, b, args.a, args.b, args.pairs)
    else:
        lines, ok = compare_by_name(a, b, args.a, args.b)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
