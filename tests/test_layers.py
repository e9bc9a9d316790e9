"""The package's shape: no import cycles, concrete drivers and launch units kept behind interfaces,
and the environment read in one place."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sparkrun_coldsnap"
NAME = PACKAGE.name

# Modules that run in the engine's own interpreter, not the plugin's.
ENGINE_SIDE = ("weights.engine_side", "setup.tiny_model", "drivers.template_launcher", "cuda.helper")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), filename=str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def walk_runtime(tree: ast.AST):
    """Every node, except what sits under ``if TYPE_CHECKING:`` (annotations only, never imported)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from walk_runtime(node)


def imported(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Package modules *name* imports, at any depth (an import inside a function still ties the two)."""
    out = set()
    for node in walk_runtime(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                # `from pkg import mod` imports the module; `from mod import name` the module itself.
                sub = "%s.%s" % (node.module, a.name)
                out.add(sub if sub in known else node.module)
    return {t for t in out if t in known and t != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imported(name, tree, known) for name, tree in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_controller_imports_no_concrete_driver_or_launch_unit():
    g = graph()
    concrete = {"%s.%s" % (NAME, m) for m in ("drivers.cpu", "drivers.n580", "drivers.n610", "criu.tool", "criu.tree", "cuda.checkpoint")}
    concrete |= {"%s.launch.%s" % (NAME, m) for m in ("local", "docker")}
    for name, deps in g.items():
        if name.startswith(NAME + ".controller"):
            assert not deps & concrete, "%s imports %s" % (name, sorted(deps & concrete))


def test_drivers_and_their_tools_import_no_launcher():
    """Launchers drive the driver's steps (a container runtime's checkpoint between its device
    steps), never the other way round."""
    below = tuple("%s.%s" % (NAME, folder) for folder in ("drivers", "criu", "cuda"))
    for name, deps in graph().items():
        if name.startswith(below):
            launchers = sorted(d for d in deps if d.startswith(NAME + ".launch"))
            assert launchers == [], "%s imports %s" % (name, launchers)


def test_the_environment_is_read_only_by_the_settings_module():
    allowed = {"%s.documents.settings" % NAME, "%s.launch.engine_env" % NAME}
    allowed |= {"%s.%s" % (NAME, m) for m in ENGINE_SIDE}
    readers = []
    for name, tree in modules().items():
        if name in allowed or any(name.startswith("%s.%s" % (NAME, m)) for m in ENGINE_SIDE):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append("%s:%d" % (name, node.lineno))
    assert readers == []


#: modules outside ``controller/`` that may import it besides the API, each with why.
CONTROLLER_DOORS = {
    "%s.api" % NAME: "the one door: every operation a caller needs, with the types it takes and hands back",
    # The per-host end of a step between hosts resolves the workload's driver and launcher where
    # it runs; it is a server under the controller's remote unit, not a caller of the controller.
    "%s.integration.unit_agent" % NAME: "the per-host end of the multi-unit steps",
}


def controller_importers(g: dict[str, set[str]]) -> dict[str, list[str]]:
    """Every module outside ``controller/`` that imports a module of it, with what it imports."""
    inside = NAME + ".controller"
    out = {}
    for name, deps in g.items():
        if name == inside or name.startswith(inside + "."):
            continue
        hits = sorted(d for d in deps if d == inside or d.startswith(inside + "."))
        if hits:
            out[name] = hits
    return out


def test_only_the_api_imports_the_controller():
    importers = controller_importers(graph())
    strays = {name: hits for name, hits in importers.items() if name not in CONTROLLER_DOORS}
    assert strays == {}, "import sparkrun_coldsnap.api instead of the controller: %s" % strays
    assert "%s.api" % NAME in importers  # the check sees the door it allows


def private_uses(name: str, tree: ast.Module, known: set[str]) -> set[tuple[str, str, int]]:
    """Where *name* reaches another package module's private name, as (module, the name it
    reaches, line): ``from mod import _x``, or ``mod._x`` on a module it imported (its own
    privates, and dunders, are its own business)."""
    aliases: dict[str, str] = {}  # local name -> the package module it stands for
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update((a.asname, a.name) for a in node.names if a.name in known and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith(NAME):
            for a in node.names:
                sub = "%s.%s" % (node.module, a.name)
                if sub in known:
                    aliases[a.asname or a.name] = sub
                elif _private(a.name) and node.module != name:
                    out.add((name, sub, node.lineno))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            target = aliases[node.value.id]
            if _private(node.attr) and target != name:
                out.add((name, "%s.%s" % (target, node.attr), node.lineno))
    return out


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


#: Private names two modules of one story still share; each goes when its story is told in one
#: place (the set only shrinks).
PRIVATE_USES_LEFT: set[tuple[str, str]] = set()


def test_no_module_uses_another_modules_private_name():
    mods = modules()
    known = set(mods)
    found = {use for name, tree in mods.items() for use in private_uses(name, tree, known)}
    assert sorted(u for u in found if u[:2] not in PRIVATE_USES_LEFT) == []
