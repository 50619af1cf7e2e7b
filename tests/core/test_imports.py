"""The package's import graph: no cycles between modules or between packages, and no import upwards.

Read from the source with `ast`, not by importing it: every import statement counts wherever it
sits (module level, inside a function, under ``if TYPE_CHECKING:``), because a function-local or
type-only import is still a dependency a reader has to hold in their head, and hiding a cycle
behind one only defers it. The one exception is a file's top-level ``if __name__ == "__main__":``
block: it runs only when ``python -m`` executes the file as the program ``__main__``, never when
another module imports it, so what it imports is the program's dependency, not the module's.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The layers, lowest first. A unit (a package, or a module directly under gpushare/) imports only
# from its own layer or those below it; CONTRIBUTING.md's "Layout" describes the same order.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # plain cards and the pure placement over them, which knows no wire format
    ("placement", ("gpushare.cards", "gpushare.placement")),
    # the wire formats, parsed into that plain data
    ("contract", ("gpushare.contract",)),
    # what a pod holds, and whether an assignment is valid
    ("rules", ("gpushare.holdings", "gpushare.assignment")),
    (
        "plumbing",
        (
            "gpushare.pb",
            "gpushare.ttrpc",
            "gpushare.kube",
            "gpushare.gpus",
            "gpushare.memlimits",
            "gpushare.settings",
            "gpushare.process",
            "gpushare.restartable",
            "gpushare.supervisor",
            "gpushare.observability",
            "gpushare.tlshttp",
            "gpushare.nodewiring",
        ),
    ),
    # the decision about a container being created, shared by the CRI shim and the NRI plugin
    ("enforcement", ("gpushare.enforcement",)),
    (
        "components",
        (
            "gpushare.deviceplugin",
            "gpushare.draplugin",
            "gpushare.crishim",
            "gpushare.advertiser",
            "gpushare.extender",
            "gpushare.webhook",
            "gpushare.nriplugin",
        ),
    ),
    (
        "commands",
        (
            "gpushare.node",
            "gpushare.inspection",
            "gpushare.simulate",
            "gpushare.sandbox",
            "gpushare.protogen",
            "gpushare.cli",
        ),
    ),
)


def source_roots() -> dict[str, Path]:
    """Package name -> folder, from pyproject.toml's package-dir (components install as gpushare.<name>)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name: ROOT / folder for name, folder in config["tool"]["setuptools"]["package-dir"].items()}


def project_modules() -> dict[str, Path]:
    """Every module of the project, by dotted name; a package by its ``__init__.py``."""
    modules: dict[str, Path] = {}
    for package, folder in source_roots().items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            # gpushare/ also holds the component folders' names only through package-dir, never on disk
            modules.setdefault(name, path)
    return modules


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of `name` that is a project module (`gpushare.x.func` -> `gpushare.x`)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _is_main_block(statement: ast.stmt) -> bool:
    """Whether ``statement`` is ``if __name__ == "__main__":``."""
    test = statement.test if isinstance(statement, ast.If) else None
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and [type(op) for op in test.ops] == [ast.Eq]
        and [getattr(c, "value", None) for c in test.comparators] == ["__main__"]
    )


def _module_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node of the file but those of its top-level ``if __name__ == "__main__":`` block."""
    for statement in tree.body:
        if not _is_main_block(statement):
            yield from ast.walk(statement)


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The project modules `module` imports, wherever in the file the statement is."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _module_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import name` imports the module pkg.name when there is one, else pkg itself
            targets = [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"] or [base]
        else:
            continue
        for target in targets:
            resolved = _known(target, modules)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def unit_of(module: str) -> str:
    """The layer entry a module belongs to (its package, or itself for a top-level module)."""
    if module == "gpushare":
        return module  # the empty namespace package, below everything
    best = ""
    for _, units in LAYERS:
        for unit in units:
            if (module == unit or module.startswith(unit + ".")) and len(unit) > len(best):
                best = unit
    return best


def layer_rank(unit: str) -> int:
    if unit == "gpushare":
        return -1
    return next(rank for rank, (_, units) in enumerate(LAYERS) if unit in units)


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[tuple[list[str], set[str]]]:
    """Each strongly connected component of more than one node, with one cycle through it in import order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(start: str) -> None:
        # iterative Tarjan: the graph is deep enough that recursion is a liability
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [(_cycle_through(component, graph), component) for component in components]


def _cycle_through(component: set[str], graph: Mapping[str, Iterable[str]]) -> list[str]:
    """A shortest cycle from the component's first member back to itself (breadth-first)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child not in component:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {sorted(component)}")


def _format_cycles(cycles: list[tuple[list[str], set[str]]]) -> str:
    return "\n".join(
        " -> ".join(cycle) + (f"\n  (one loop of {len(members)}: {', '.join(sorted(members))})" * (len(members) > 2))
        for cycle, members in sorted(cycles, key=lambda found: found[0])
    )


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Relative, `from pkg import module`, function-local and TYPE_CHECKING imports all count; the
    program's own ``if __name__ == "__main__":`` block doesn't."""
    for name in "abcdefg":
        (tmp_path / f"{name}.py").write_text("")
    (tmp_path / "main.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import a\n"
        "from .b import thing\n"
        "from gpushare.pkg import c\n"
        "import gpushare.pkg.d.attribute\n"
        "if TYPE_CHECKING:\n"
        "    from gpushare.pkg.e import Hint\n"
        "def later():\n"
        "    from gpushare.pkg import f\n"
        "    import json\n"
        "if __name__ == '__main__':\n"
        "    from gpushare.pkg import g\n"
    )
    modules = {f"gpushare.pkg.{name}": tmp_path / f"{name}.py" for name in "abcdefg"}
    modules["gpushare.pkg"] = tmp_path / "__init__.py"
    assert imports_of("gpushare.pkg.main", tmp_path / "main.py", modules) == {
        f"gpushare.pkg.{name}" for name in "abcdef"
    }
    # and the component folders are read as the gpushare.<name> packages they install as
    graph = import_graph()
    assert "gpushare.deviceplugin.decision" in graph["gpushare.deviceplugin.allocator"]
    assert "gpushare.pb.cri_pb2" in graph["gpushare.pb.cri_pb2_grpc"]


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(module for module in project_modules() if not unit_of(module))
    assert not unplaced, f"add these to a layer in LAYERS (and CONTRIBUTING.md's Layout): {unplaced}"


def test_no_module_imports_a_cycle() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles between modules:\n" + _format_cycles(cycles)


def test_no_unit_imports_a_cycle() -> None:
    """Packages too: gpus/ importing memlimits/ and memlimits/ importing gpus/ is a cycle, whichever modules."""
    units: dict[str, set[str]] = {}
    for module, imported in import_graph().items():
        units.setdefault(unit_of(module), set()).update(unit_of(target) for target in imported)
    for unit, imported in units.items():
        imported.discard(unit)
    cycles = find_cycles(units)
    assert not cycles, "import cycles between packages:\n" + _format_cycles(cycles)


def test_no_import_reaches_up_a_layer() -> None:
    upward = sorted(
        f"{module} ({LAYERS[layer_rank(unit_of(module))][0]}) imports "
        f"{target} ({LAYERS[layer_rank(unit_of(target))][0]})"
        for module, imported in import_graph().items()
        for target in imported
        if layer_rank(unit_of(target)) > layer_rank(unit_of(module))
    )
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def component_crossings(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Each import of one component's module by another component's, as ``importer -> imported``."""
    components = dict(LAYERS)["components"]
    return sorted(
        f"{module} -> {target}"
        for module, imported in graph.items()
        for target in imported
        if unit_of(module) in components and unit_of(target) in components and unit_of(target) != unit_of(module)
    )


def test_no_component_imports_another() -> None:
    """A rule two components read lives below them (``contract/``, ``holdings/``), where a reader finds it
    by its name, not inside one of them. Running several components together is the commands' job, above
    them (``gpushare.node`` runs the node-side ones in one process, ``gpushare.cli`` starts each), so no
    import between two components is needed, and none is allowed."""
    assert component_crossings(
        {
            "gpushare.extender.dra": {"gpushare.advertiser.resourceslice", "gpushare.contract.dra"},
            "gpushare.extender.bind": {"gpushare.extender.cache"},
            "gpushare.node": {"gpushare.advertiser.agent"},
        }
    ) == ["gpushare.extender.dra -> gpushare.advertiser.resourceslice"]
    crossings = component_crossings(import_graph())
    assert not crossings, "imports between components (move what they share below them):\n" + "\n".join(crossings)
