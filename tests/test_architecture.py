"""attnref's layers: no import circle anywhere in the package, the engine imports no
family, and no part of the conformance package imports the bench.

Read from the source (every ``import``, at the top of a module or inside a function,
but for those only a type checker runs): a family is one module of
`attnref.conformance.families`; the engine below it finds a family through the table the
registry fills (`attnref.conformance.family`), never by importing one; the bench is a
client of the families (it hands the worker its jobs as modules to import, `Supervised`'s
``jobs``), never the other way.
"""

import ast
from pathlib import Path

import attnref

PACKAGE = Path(attnref.__file__).parent
#: the engine: what runs every family's audit, and must name none
ENGINE = (
    "attacks", "calls", "cases", "checks", "declarations", "executors", "family", "jobs",
    "kernels", "mutants", "options", "oracle", "profiles", "properties", "report", "runner",
    "sandboxed", "serving", "serving_checks", "strategies", "verdicts", "wire", "worker",
)  # fmt: skip
#: what lies above the engine: the registry and the resolution of backends by name
ABOVE = ("attnref.conformance.families", "attnref.conformance.backends")


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("attnref", *path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _type_checking_only(tree: ast.AST) -> set[int]:
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            hidden |= {id(sub) for sub in ast.walk(node)}
    return hidden


def _imports() -> dict[str, set[str]]:
    names = _module_names()
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text())
        hidden = _type_checking_only(tree)
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in names else node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circle() -> None:
    assert _circles(_imports()) == []


def test_no_part_of_the_conformance_package_imports_the_bench() -> None:
    graph = _imports()
    for module, deps in graph.items():
        if module.startswith("attnref.conformance"):
            bench = sorted(d for d in deps if d.startswith("attnref.bench"))
            assert not bench, f"{module} imports {bench}: the bench is the families' client"


def test_the_engine_imports_no_family_and_not_the_registry() -> None:
    graph = _imports()
    for name in ENGINE:
        module = f"attnref.conformance.{name}"
        assert module in graph, module
        above = sorted(d for d in graph[module] if d.startswith(ABOVE))
        assert not above, f"{module} imports {above}: the engine must find families by name"


def test_the_check_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
