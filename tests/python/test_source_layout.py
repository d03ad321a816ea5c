"""The source tree keeps the rules of docs/design.md: the kernels' host code reads one
environment variable (the documented kill switch), no Hopper file includes a portable-kernel
one, the quoted includes of src/ form no cycle, and torch never enters include/ or src/."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
SOURCES = sorted(p for p in SRC.rglob("*") if p.suffix in {".h", ".cuh", ".cpp", ".cu"})
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def quoted_includes(path: Path) -> list[Path]:
    """The files a source's quoted includes resolve to (its own folder first, then src/ and
    include/, as the build's include path has them); unresolved names are skipped."""
    found = []
    for name in INCLUDE.findall(path.read_text()):
        for base in (path.parent, SRC, ROOT / "include"):
            target = (base / name).resolve()
            if target.is_file():
                found.append(target)
                break
    return found


def find_cycle(graph: dict[Path, list[Path]]) -> list[Path] | None:
    """A cycle of the directed graph as a list of nodes, or None."""
    state: dict[Path, int] = {}
    stack: list[Path] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        stack.pop()
        return None

    for node in graph:
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_only_environment_variable_is_the_kill_switch():
    readers = {}
    for path in SOURCES:
        text = path.read_text()
        if "getenv" in text:
            readers[path.relative_to(ROOT).as_posix()] = re.findall(r'getenv\("([^"]+)"\)', text)
    assert readers == {"src/cuda/dispatch/sm90_support.h": ["VIDATTN_DISABLE_SM90"]}


def test_no_sm90_file_includes_an_sm80_one():
    sm90 = SRC / "cuda" / "attention" / "sm90"
    sm80 = (SRC / "cuda" / "attention" / "sm80").resolve()
    offenders = [(p.relative_to(ROOT).as_posix(), t.relative_to(ROOT).as_posix())
                 for p in SOURCES if sm90 in p.parents
                 for t in quoted_includes(p) if sm80 in t.parents]
    assert offenders == []


def test_the_include_graph_of_src_has_no_cycle():
    graph = {p.resolve(): quoted_includes(p) for p in SOURCES}
    assert len(graph) > 50  # the walk found the tree
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(p.relative_to(ROOT).as_posix() for p in cycle)


def test_the_cycle_finder_finds_a_cycle():
    a, b, c = Path("/a"), Path("/b"), Path("/c")
    assert find_cycle({a: [b], b: [c], c: [a]}) == [a, b, c, a]
    assert find_cycle({a: [b], b: [c], c: []}) is None


@pytest.mark.parametrize("folder", ["include", "src"])
def test_torch_never_enters_the_core(folder):
    offenders = [p.relative_to(ROOT).as_posix()
                 for p in (ROOT / folder).rglob("*") if p.is_file()
                 and re.search(r"#\s*include\s*[<\"](torch|ATen|c10)/", p.read_text())]
    assert offenders == []
