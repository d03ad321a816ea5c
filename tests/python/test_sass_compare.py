"""tools/profile/sass_compare.py on hand-written cuobjdump listings (no cuobjdump needed): what
a body is, the comparison by name, and --by-body, which must match renamed kernels body for
body and count repeated bodies."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "profile"))
import sass_compare  # noqa: E402


def body(mangled, *instrs, trailer=()):
    """A function's lines as sass_listings keeps them: instructions with their encodings,
    then whatever cuobjdump prints before the next function (``trailer``)."""
    lines = ["\t.headerflags\t@\"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\""]
    for i, text in enumerate(instrs):
        lines.append(f"        /*{16 * i:04x}*/                   {text} ;   /* 0x000000{i:010x} */")
        lines.append("                                                   /* 0x000fe40000000f00 */")
    return lines + ["\t\t.........."] + list(trailer)


def listing(*functions):
    """[(mangled, demangled, lines)] with each function's digest inputs."""
    return [(m, d, lines) for m, d, lines in functions]


def digests(listings, anonymous=False):
    return [(d, sass_compare.body_digest(m, lines, anonymous)) for m, d, lines in listings]


LOOP = ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ", "@P1 BRA 0x10", "EXIT")


def test_a_body_is_its_instructions_only():
    plain = body("_Z1fv", *LOOP)
    # The header of the next cubin (naming another source file) is not part of the body...
    moved = body("_Z1fv", *LOOP, trailer=["Fatbin elf code:", "identifier = other/file.cu"])
    assert sass_compare.body_digest("_Z1fv", plain) == sass_compare.body_digest("_Z1fv", moved)
    # ...an instruction is, and so are the control bits of its encoding.
    changed = body("_Z1fv", LOOP[0], "@P2 BRA 0x10", LOOP[2])
    assert sass_compare.body_digest("_Z1fv", plain) != sass_compare.body_digest("_Z1fv", changed)
    bits = [line.replace("0x000fe400", "0x000fe200") for line in plain]
    assert sass_compare.body_digest("_Z1fv", plain) != sass_compare.body_digest("_Z1fv", bits)


def test_by_name_lists_what_differs_and_what_is_missing():
    a = digests(listing(("_Z1fv", "f()", body("_Z1fv", *LOOP)),
                        ("_Z1gv", "g()", body("_Z1gv", "NOP", "EXIT"))))
    b = digests(listing(("_Z1fv", "f()", body("_Z1fv", *LOOP)),
                        ("_Z1hv", "h()", body("_Z1hv", "NOP", "EXIT"))))
    lines, ok = sass_compare.compare_by_name(a, b)
    assert not ok
    assert lines == ["1 identical, 0 differ, 1 only in A, 1 only in B", "only in A : g()",
                     "only in B : h()"]
    assert sass_compare.compare_by_name(a, a) == (["2 identical, 0 differ, 0 only in A, "
                                                   "0 only in B"], True)


def test_by_body_matches_renamed_kernels_and_counts_repeats():
    # Two kernels with the same body (two instances that compile alike) and one other; B
    # renames all three, and its kernels call a renamed helper.
    a = listing(("_ZN3old1kILi1EEEvv", "old::k<1>()", body("_ZN3old1kILi1EEEvv", *LOOP)),
                ("_ZN3old1kILi2EEEvv", "old::k<2>()", body("_ZN3old1kILi2EEEvv", *LOOP)),
                ("_ZN3old1gEv", "old::g()", body("_ZN3old1gEv", "CALL.REL `(_ZN3old6helperEv)",
                                                 "EXIT")))
    b = listing(("_ZN3new1kILb1EEEvv", "new::k<true>()", body("_ZN3new1kILb1EEEvv", *LOOP)),
                ("_ZN3new1kILb0EEEvv", "new::k<false>()", body("_ZN3new1kILb0EEEvv", *LOOP)),
                ("_ZN3new1gEv", "new::g()", body("_ZN3new1gEv", "CALL.REL `(_ZN3new6helperEv)",
                                                 "EXIT")))
    # By name nothing matches; by body everything does, once per function.
    assert not sass_compare.compare_by_name(digests(a), digests(b))[1]
    lines, ok = sass_compare.compare_by_body(digests(a, True), digests(b, True), pairs=True)
    assert ok
    assert lines[:2] == ["A: 3 functions, 2 distinct bodies; B: 3 functions, 2 distinct bodies",
                         "3 of A's 3 bodies have an identical body in B; 3 of B's 3 in A"]
    assert "renamed: old::g() -> new::g()" in lines
    # A body that appears twice in A but once in B is a missing function, not a match.
    lines, ok = sass_compare.compare_by_body(digests(a, True), digests(b[1:], True))
    assert not ok
    assert lines[1] == "2 of A's 3 bodies have an identical body in B; 2 of B's 2 in A"
    assert lines[2:] == ["no identical body in the other library: A: old::k<2>()"]
    # A changed instruction is a difference whatever the names.
    changed = b[:2] + [("_ZN3new1gEv", "new::g()", body("_ZN3new1gEv", "NOP", "EXIT"))]
    lines, ok = sass_compare.compare_by_body(digests(a, True), digests(changed, True))
    assert not ok
    assert lines[2:] == ["no identical body in the other library: A: old::g()",
                         "no identical body in the other library: B: new::g()"]
