"""The bench package's import graph has no cycle: every import between its modules (at module
level or inside a function, both count: a late import only hides a cycle until it runs) goes
one way. Read from the source with ast, so it needs no op library."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "python" / "vidattn" / "bench"


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """{module: the modules of the package under ``root`` it imports}, names relative to
    root's parent (``bench.cases``); imports of anything outside the package are left out."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets.append(stem)
                targets += [f"{stem}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            for target in targets:
                # "vidattn.bench.x" spelled absolutely is the same module as "bench.x".
                target = target.removeprefix("vidattn.")
                # A module's own packages run before it whatever it imports: not an edge.
                if target in modules and not f"{name}.".startswith(f"{target}."):
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as [a, b, ..., a], or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_bench_package_has_no_import_cycle():
    graph = import_graph(BENCH)
    assert "bench.cases" in graph and "bench.vsa_case" in graph
    # The cases are put together in one direction: the registry imports the case modules.
    assert {"bench.blocksparse_case", "bench.vsa_case", "bench.dense_case"} <= graph["bench.cases"]
    assert find_cycle(graph) == []


def test_cycle_finder_sees_a_cycle(tmp_path):
    pkg = tmp_path / "bench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import y\n")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("from vidattn.bench.a import y\n")
    assert find_cycle(import_graph(pkg)) == ["bench.a", "bench.b", "bench.c", "bench.a"]


def test_each_case_module_imports_alone():
    """Each case module first in a fresh interpreter: what a cycle breaks at import time."""
    for name in ("base", "dense_case", "blocksparse_case", "vsa_case", "cases"):
        proc = subprocess.run([sys.executable, "-c", f"import vidattn.bench.{name}"],
                              capture_output=True, text=True)
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
