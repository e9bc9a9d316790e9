"""The package's shape: folders that are layers (an allowlist of which folder imports which, imports
inside functions counted), no import cycles between modules, one door into the controller, no
module reaching another's private names, and the environment read in one place."""

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


def folder(module: str) -> str:
    """The layer a module belongs to: its folder under the package, or the module itself at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def folder_edges(g: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """Every import from one folder into another, with the modules that make it."""
    out: dict[tuple[str, str], list[str]] = {}
    for name, deps in g.items():
        for dep in deps:
            if folder(name) != folder(dep):
                out.setdefault((folder(name), folder(dep)), []).append("%s -> %s" % (name, dep))
    return out


#: The layers, top to bottom: a folder imports the ones below it. Entries (the CLI, sparkrun's
#: integration), then the operations (lifecycle, benchmarks, the API), the stories (controller), the
#: units they run on, the launchers, drivers and the tools under them, down to documents and the
#: single-module foundations.
LAYERS = (
    "__main__", "cli", "doctor", "integration", "lifecycle", "bench_units", "bench_load", "bench", "capabilities", "api", "controller", "units", "setup",
    "launch", "compat", "weights", "capsule", "drivers", "criu", "cuda", "engines", "host", "documents",
    "extensions", "hookspecs", "secrets", "digests", "errors", "progress", "__init__",
)  # fmt: skip

#: Which folders each folder may import: every import across folders must be here, and every entry
#: must still be used (an allowance nothing needs fails too, so the list cannot go stale).
ALLOWED = {
    "__main__": {"cli"},
    "cli": {"api", "bench", "bench_load", "bench_units", "capabilities", "capsule", "criu", "digests", "doctor", "documents", "errors", "host", "integration", "launch", "lifecycle", "progress", "setup", "weights"},
    "doctor": {"__init__", "capsule", "criu", "extensions", "host", "integration", "launch", "setup"},
    "integration": {"api", "capsule", "cli", "documents", "errors", "extensions", "host", "launch", "lifecycle", "progress", "units"},
    "lifecycle": {"api", "bench", "capsule", "documents", "engines", "errors", "extensions", "host", "integration", "launch", "progress", "weights"},
    "bench_units": {"api", "bench", "capsule", "documents", "errors", "launch", "progress", "units"},
    "bench_load": {"__init__", "api", "bench", "capsule", "documents", "engines", "errors", "extensions", "host", "progress", "weights"},
    "bench": {"__init__", "api", "capsule", "documents", "errors", "host", "progress", "weights"},
    "capabilities": {"__init__", "capsule", "documents", "errors", "extensions", "host", "launch"},
    "api": {"capsule", "controller", "documents", "errors", "host", "launch", "progress", "units", "weights"},
    "controller": {"capsule", "compat", "documents", "engines", "errors", "extensions", "host", "launch", "progress", "secrets", "units", "weights"},
    "units": {"capsule", "compat", "criu", "digests", "documents", "drivers", "engines", "errors", "extensions", "host", "launch", "weights"},
    "setup": {"criu", "documents", "errors", "host", "launch"},
    "launch": {"criu", "cuda", "digests", "documents", "errors", "host", "weights"},
    "compat": {"documents", "engines", "host", "weights"},
    "weights": {"digests", "documents", "drivers", "engines", "errors", "host", "progress"},
    "capsule": {"__init__", "digests", "documents", "errors", "host", "progress", "weights"},
    "drivers": {"criu", "cuda", "documents", "errors", "hookspecs", "host", "progress"},
    "criu": {"documents", "errors", "host", "progress"},
    "cuda": {"documents", "engines", "errors", "host"},
    "engines": {"documents", "errors", "hookspecs", "weights"},
    "host": {"digests", "documents", "errors", "secrets", "weights"},
    "documents": {"__init__", "capabilities", "digests", "errors", "host", "secrets"},
    "extensions": {"errors", "hookspecs"},
    "secrets": {"digests"},
}

#: The imports that still go up a layer, each with why; the set only shrinks.
BACK_EDGES = {
    ("integration", "cli"): "sparkrun's plugin entry registers the click group of the verbs",
    ("lifecycle", "integration"): "the lifecycle reads sparkrun's workload records and placement",
    ("capsule", "weights"): "a transfer carries the weights artifact and the native payload beside the capsule",
    ("engines", "weights"): "the vLLM adapter points the engine at the engine-side loader's folder",
    ("host", "weights"): "the bandwidth probe drops the page cache as the weights' preparation does",
    ("documents", "capabilities"): "the schema writer renders the capabilities document",
    ("documents", "host"): "receipts are written atomically",
}


def test_every_import_across_folders_is_allowed():
    strays = {edge: mods for edge, mods in folder_edges(graph()).items() if edge[1] not in ALLOWED.get(edge[0], set())}
    assert strays == {}, "imports across folders not in ALLOWED (import a lower layer, or move the code): %s" % strays


def test_every_allowance_is_used():
    used = set(folder_edges(graph()))
    unused = sorted((a, b) for a, bs in ALLOWED.items() for b in bs if (a, b) not in used)
    assert unused == [], "ALLOWED names imports nothing makes any more: remove them %s" % unused


def test_folders_import_downward_but_for_the_named_back_edges():
    rank = {name: i for i, name in enumerate(LAYERS)}
    assert set(ALLOWED) | {b for bs in ALLOWED.values() for b in bs} <= set(rank), "a folder missing from LAYERS"
    assert {folder(m) for m in modules()} <= set(rank), "a folder missing from LAYERS"
    upward = {(a, b) for a, bs in ALLOWED.items() for b in bs if rank[b] < rank[a]}
    assert upward == set(BACK_EDGES), "imports going up a layer: %s; named but going down or gone: %s" % (sorted(upward - set(BACK_EDGES)), sorted(set(BACK_EDGES) - upward))


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
