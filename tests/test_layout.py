"""The package's shape: no import circle among fastmm's modules (function-level imports count:
a lazy import that closes a loop still ties two layers together), and one module per kernel
family, named as its source under cuda_src/."""
from __future__ import annotations

import ast
from pathlib import Path

import fastmm
from fastmm.families import FAMILIES

PACKAGE = Path(fastmm.__file__).parent
REPO = PACKAGE.parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """fastmm modules that ``path`` imports anywhere in its body (``from . import x`` of a
    submodule counts as importing it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("fastmm")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("fastmm"):
                continue
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules}
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(path, name, modules) for name, path in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, or None. The top package is left out as a target: ``from . import x``
    names it, but what is imported is the submodule x."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt == "fastmm":
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if state.get(nxt) is None:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if state.get(node) is None:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_of_fastmm_has_no_circle():
    assert _cycle(import_graph()) is None, " -> ".join(_cycle(import_graph()))


def test_the_circle_finder_finds_a_circle():
    """The check above can fail: a made-up graph with a loop through three modules is caught."""
    graph = {"x.a": {"x.b"}, "x.b": {"x.c"}, "x.c": {"x.a"}, "x.d": set()}
    assert _cycle(graph) == ["x.a", "x.b", "x.c", "x.a"]
    assert _cycle({"x.a": {"x.b"}, "x.b": set()}) is None


def test_a_call_flows_one_way_api_plan_runtime():
    """The planner and the families import no torch-side module, and the runtime imports neither
    the api nor the dispatcher: data flows api -> dispatch -> plan -> runtime."""
    graph = import_graph()
    upper = {"fastmm.api", "fastmm.dispatch", "fastmm.fast_path", "fastmm.ops", "fastmm.nn", "fastmm.patching",
             "fastmm.shapes", "fastmm.explain", "fastmm.tuning"}
    for name, deps in graph.items():
        if name.startswith(("fastmm.families", "fastmm.runtime")) or name in ("fastmm.plan", "fastmm.problem"):
            assert not deps & upper, (name, deps & upper)
        if name.startswith("fastmm.families") or name == "fastmm.plan":
            assert not any(d.startswith("fastmm.runtime") for d in deps), (name, deps)
    assert "fastmm.api" not in graph["fastmm.ops"]


def test_each_family_has_a_module_named_as_its_source():
    for name, fam in FAMILIES.items():
        stem = fam.source.removesuffix(".cu")
        assert (PACKAGE / "families" / f"{stem}.py").is_file(), fam.source
        assert (REPO / "cuda_src" / fam.source).is_file() or (PACKAGE / "cuda_src" / fam.source).is_file()
        assert type(fam).__module__ == f"fastmm.families.{stem}", (name, type(fam).__module__)


def test_families_are_frozen():
    """A variant is a new instance handed to the planner, never a switch flipped on the registry."""
    import dataclasses

    import pytest

    for fam in FAMILIES.values():
        with pytest.raises(dataclasses.FrozenInstanceError):
            fam.name = "other"
