"""The house's floors, read from the source: what imports what, and how long a module is.

docs/architecture.md, "The floors": the protocol and the plain helpers at the
bottom (`edgebus.core`), the agents above it (`node_agent`, `broker`,
`plant_config`), the operator's tools on top (the rest of `edgebus`). Every
import is counted, at module level, under TYPE_CHECKING or inside a function: a
function-local import that climbs a floor or closes a circle still ties the
lower floor to the upper one, it only defers the failure to the first call.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("edgebus", "node_agent", "broker", "plant_config")
CORE = "edgebus.core"
AGENTS = ("node_agent", "broker", "plant_config")
# The target (issue 32, "The house"): no module over 600 lines in the runtime packages.
MAX_LINES = 600
RUNTIME = (CORE, *AGENTS)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> dict[str, Path]:
    return {module_name(path): path
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


MODULES = source_files()


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def floor(name: str) -> int:
    """0: the bottom room (and the `edgebus` package itself, which importing it runs);
    1: the agents; 2: the operator's tools."""
    if name == "edgebus" or within(name, CORE):
        return 0
    if any(within(name, package) for package in AGENTS):
        return 1
    return 2


def known(name: str) -> str | None:
    """The module of ours that importing `name` runs last, or None for another project's."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str) -> Iterator[str]:
    """Every module of ours that module `name` imports, wherever in the file."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import module` imports that module; `from module import name`,
            # the module (known() falls back to it).
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            found = known(target)
            if found is not None and found != name:
                yield found


GRAPH = {name: sorted(set(imports(name))) for name in MODULES}


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
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

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_checks_see_what_they_look_for() -> None:
    # The checks below pass on a clean house; these show that they would see a dirty one.
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert cycles({"a": ["b"], "b": [], "c": ["a", "b"]}) == []
    assert [floor(name) for name in ("edgebus", "edgebus.core.frames", "broker.acl",
                                     "plant_config", "edgebus.cli")] == [0, 0, 1, 1, 2]
    assert "edgebus.core.frames" in GRAPH["node_agent.stage"]
    # A function-local import counts: the CLI imports the stage agent inside `node`.
    assert "node_agent.stage" in GRAPH["edgebus.cli"]


def test_the_modules_are_found() -> None:
    # A wrong ROOT would find nothing and pass every check below.
    assert {"edgebus.core.frames", "node_agent.stage", "broker.embedded",
            "plant_config.schema", "edgebus.cli"} <= MODULES.keys()


def test_no_import_climbs_a_floor() -> None:
    climbs = [f"{name} imports {target}" for name, targets in GRAPH.items()
              for target in targets if floor(target) > floor(name)]
    assert not climbs, "imports that climb a floor (docs/architecture.md, 'The floors'):\n" + \
        "\n".join(climbs)


def test_no_import_circles() -> None:
    circles = cycles(GRAPH)
    assert not circles, "modules that import each other, in a circle:\n" + \
        "\n".join(" <-> ".join(circle) for circle in circles)


def test_no_runtime_module_is_too_long() -> None:
    long = {str(path.relative_to(ROOT)): lines for name, path in MODULES.items()
            if any(within(name, package) for package in RUNTIME)
            and (lines := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"runtime modules over {MAX_LINES} lines: {long}"
