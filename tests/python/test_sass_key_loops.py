"""tools/profile/sass_key_loops.py's loop finder on hand-written SASS (no cuobjdump needed):
the static check of key loops must see a loop's wgmma, divergence guards and local accesses,
and must not take a slow path's jump back for a loop."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "profile"))
import sass_key_loops  # noqa: E402


def listing(lines):
    """[(address, text)] at 16-byte steps, as cuobjdump prints them."""
    return [(16 * i, t) for i, t in enumerate(lines)]


KERNEL = listing([
    "MOV R1, c[0x0][0x28]",                      # 0x00
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2], R3",  # 0x10: the loop starts
    "@!P0 BRA 0x100",                            # 0x20: to the retry block, out of line
    "BRA.DIV UR4, 0x120",                        # 0x30
    "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT",
    "LDL R5, [R1+0x8]",                          # 0x50
    "HGMMA.64x128x16.F32.BF16 R24, R120, gdesc[UR8].tnspB, R24",
    "ISETP.NE.AND P1, PT, R6, RZ, PT",           # 0x70
    "@P1 BRA 0x10",                              # 0x80: the loop's back edge
    "EXIT",                                      # 0x90
    "BRA 0x90",                                  # 0xa0: the end marker jumps back to EXIT
    "NOP", "NOP", "NOP", "NOP",                  # 0xb0 .. 0xe0
    "NOP",                                       # 0xf0
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2], R3",  # 0x100: the retry
    "BRA 0x30",                                  # 0x110: back into the loop, across EXIT
    "WARPSYNC.ALL",                              # 0x120
    "BRA 0x40",                                  # 0x130
])


def test_finds_the_key_loop_and_what_it_holds():
    loops = sass_key_loops.key_loops(KERNEL)
    # One loop, 0x10 .. 0x80: 8 instructions, 2 HGMMA, 1 BRA.DIV, 1 local access.
    assert loops == [(8, 2, 1, 1)]


def test_a_loop_without_wgmma_is_not_a_key_loop():
    no_mma = [(a, t.replace("HGMMA", "IMAD")) for a, t in KERNEL]
    assert sass_key_loops.key_loops(no_mma) == []


def test_the_innermost_wgmma_loop_is_reported():
    # An outer loop around the whole of KERNEL's loop (back edge at 0x88 to 0x00).
    nested = KERNEL[:9] + [(0x88, "@P2 BRA 0x0")] + KERNEL[9:]
    assert sass_key_loops.key_loops(nested) == [(8, 2, 1, 1)]
