"""The house rules of src/, read from the imports with ``ast`` (issue 44).

Every import counts: at module level, inside functions (a lazy import still makes a dependency, and hiding a
cycle behind one is what this test is for) and under ``TYPE_CHECKING``. Relative imports are resolved.

* No import cycle between the modules of a package (a strongly connected component of more than one module).
* tracesynth and dooly never import each other; atomicio imports neither.
* A dooly module imports only from its own layer or the layers below it (:data:`DOOLY_LAYERS`).

Run ``python tests/test_layers.py`` to print today's cycles and upward imports.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("tracesynth", "dooly", "atomicio")

#: dooly's layers, lowest first; a module may import from its own layer and the ones below. An entry names a
#: module or a package (and everything under it); the longest matching entry places a module. Each layer but
#: the app layer is a folder of src/dooly (issue 44).
DOOLY_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # what everything shares: errors, numbers, the request/batch entities, byte units, config digests, model configs
    ("core", ("core",)),
    # the inference engines depend only on core
    ("engines", ("engines",)),
    # tracing a model through an engine into operator signatures
    ("trace", ("trace",)),
    # the profile DB, and the shape model fitted over its points (the profiler's budget plans with it)
    ("db", ("db",)),
    ("profile", ("profile",)),
    ("predict", ("predict",)),
    ("simulate", ("simulator",)),
    # real serving runs to validate the simulator against (vllm_serving drives `vllm serve`, not an Engine)
    ("serve", ("serve",)),
    ("app", ("api", "layout_sweep", "report", "demo", "vidur_export")),
    ("cli", ("cli", "__main__")),
)

#: Packages whose internal cycles are tolerated for now, each with its reason: a cycle is excused only when
#: every module in it lies in one of these packages.
KNOWN_CYCLES: dict[str, str] = {}  # package -> why its cycles are tolerated (none are, today)


_PYX: set[str] = set()  # modules whose source is Cython


@cache
def modules() -> dict[str, Path]:
    """Every module under src/ by dotted name (a package by its own name, from its ``__init__``; a compiled
    Cython module by its ``.pyx``)."""
    out = {}
    for path in sorted([*SRC.rglob("*.py"), *SRC.rglob("*.pyx")]):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[0] not in PACKAGES:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
        if path.suffix == ".pyx":
            _PYX.add(".".join(parts))
    return out


def imported_names(name: str, source: str, is_package: bool = False) -> Iterator[tuple[str, int]]:
    """(dotted name, line) of everything the module ``name`` imports, relative imports resolved (a Cython
    source: its plain ``import X`` / ``from X import`` lines, Python's parser cannot read the rest)."""
    if name in _PYX:
        for line, text in enumerate(source.splitlines(), 1):
            m = re.match(r"\s*(?:from\s+([\w.]+)\s+c?import|import\s+([\w.]+))", text)
            if m:
                yield m.group(1) or m.group(2), line
        return
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                yield f"{base}.{alias.name}", node.lineno


@cache
def graph() -> dict[str, dict[str, int]]:
    """module -> {imported module of src/: first line importing it}."""
    mods = modules()
    out: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges: dict[str, int] = {}
        for target, line in imported_names(name, path.read_text(), path.name == "__init__.py"):
            while target and target not in mods:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.setdefault(target, line)
        out[name] = edges
    return out


def cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in g:
        if root in index:
            continue
        work = [(root, iter(g[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(g[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(component: list[str]) -> str:
    g, members = graph(), set(component)
    edges = [f"{src}:{line} -> {dst}" for src in component for dst, line in g[src].items() if dst in members]
    return "\n  ".join([f"cycle {' / '.join(component)}:", *edges])


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_of(module: str) -> int | None:
    """The index in :data:`DOOLY_LAYERS` of a dooly module, by its longest matching entry."""
    best, best_len = None, -1
    for rank, (_, entries) in enumerate(DOOLY_LAYERS):
        for entry in entries:
            full = f"dooly.{entry}"
            if _within(module, full) and len(full) > best_len:
                best, best_len = rank, len(full)
    return best


def upward_imports() -> list[str]:
    out = []
    for src, edges in graph().items():
        if not src.startswith("dooly."):
            continue
        for dst, line in edges.items():
            low, high = layer_of(src), layer_of(dst)
            if low is not None and high is not None and high > low:
                out.append(f"{src}:{line} ({DOOLY_LAYERS[low][0]}) imports {dst} ({DOOLY_LAYERS[high][0]})")
    return out


def test_every_dooly_module_has_a_layer() -> None:
    unplaced = [m for m in modules() if m.startswith("dooly.") and layer_of(m) is None]
    assert not unplaced, f"place these modules in DOOLY_LAYERS: {unplaced}"


def test_no_import_cycles() -> None:
    bad = [c for c in cycles() if not any(all(_within(m, pkg) for m in c) for pkg in KNOWN_CYCLES)]
    assert not bad, "import cycles (function-level imports count):\n" + "\n".join(_describe(c) for c in bad)


def test_no_upward_imports_between_dooly_layers() -> None:
    test_every_dooly_module_has_a_layer()
    bad = upward_imports()
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_packages_stay_apart() -> None:
    bad = []
    for src, edges in graph().items():
        top = src.partition(".")[0]
        for dst, line in edges.items():
            other = dst.partition(".")[0]
            if (top, other) in {("dooly", "tracesynth"), ("tracesynth", "dooly")} or (
                top == "atomicio" and other != "atomicio"
            ):
                bad.append(f"{src}:{line} imports {dst}")
    assert not bad, "imports across packages: " + "; ".join(bad)


def test_the_graph_sees_function_level_and_relative_imports() -> None:
    g = graph()
    assert "dooly.engines.hf" in g["dooly.engines"]  # imported inside a factory function
    assert len(g) > 100 and all(m.partition(".")[0] in PACKAGES for m in g)
    source = "from . import a\nfrom ..b import c\ndef f():\n    import d.e\n"
    assert [n for n, _ in imported_names("p.q.m", source)] == ["p.q.a", "p.b.c", "d.e"]
    assert [n for n, _ in imported_names("p.q", "from .r import s\n", is_package=True)] == ["p.q.r.s"]


if __name__ == "__main__":
    for component in cycles():
        print(_describe(component))
    for line in upward_imports():
        print(line)
