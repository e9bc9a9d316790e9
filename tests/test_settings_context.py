"""Settings per thread and per task: two operations of one process each read their own, and a
pool or thread the plugin starts runs its caller's work under its caller's settings."""

from __future__ import annotations

import ast
import asyncio
import threading
from pathlib import Path

from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.host.background import in_background
from sparkrun_coldsnap.host.threads import ContextPool, start_thread

PACKAGE = Path(__file__).resolve().parent.parent / "sparkrun_coldsnap"
# Modules that run in the engine's own interpreter, where the plugin's settings are not read.
ENGINE_SIDE = ("weights/engine_side/", "cuda/helper.py")


def _settings(name: str) -> settings_mod.Settings:
    return settings_mod.Settings.from_environ({"COLDSNAP_HOME": "/tmp/%s" % name})


def test_two_threads_under_their_own_settings_each_read_their_own():
    both_inside = threading.Barrier(2, timeout=10)
    seen: dict[str, list[Path]] = {}

    def operation(name: str) -> None:
        with settings_mod.using(_settings(name)):
            both_inside.wait()  # each is inside its block while the other is inside its own
            seen[name] = [settings_mod.current().home]
            both_inside.wait()
            seen[name].append(settings_mod.current().home)

    threads = [threading.Thread(target=operation, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": [Path("/tmp/a")] * 2, "b": [Path("/tmp/b")] * 2}


def test_a_block_ends_with_the_settings_from_before_it():
    installed = settings_mod.install(_settings("installed"))
    with settings_mod.using(_settings("outer")), settings_mod.using(_settings("inner")):
        assert settings_mod.current().home == Path("/tmp/inner")
    assert settings_mod.current() is installed


def test_a_pool_started_under_settings_runs_every_call_under_them():
    settings_mod.install(_settings("process"))
    with settings_mod.using(_settings("caller")), ContextPool(4) as pool:
        homes = list(pool.map(lambda _: settings_mod.current().home, range(16)))
        submitted = pool.submit(lambda: settings_mod.current().home).result()
    assert homes == [Path("/tmp/caller")] * 16 and submitted == Path("/tmp/caller")


def test_a_call_submitted_outside_the_block_reads_what_its_submitter_reads():
    settings_mod.install(_settings("process"))
    with ContextPool(1) as pool:
        with settings_mod.using(_settings("caller")):
            inside = pool.submit(lambda: settings_mod.current().home).result()
        outside = pool.submit(lambda: settings_mod.current().home).result()
    assert (inside, outside) == (Path("/tmp/caller"), Path("/tmp/process"))


def test_background_work_and_a_started_thread_read_their_starters_settings():
    settings_mod.install(_settings("process"))
    seen: list[Path] = []
    with settings_mod.using(_settings("caller")):
        background = in_background(lambda: settings_mod.current().home)
        start_thread(lambda: seen.append(settings_mod.current().home), name="coldsnap-test").join()
    assert background.result(timeout=10) == Path("/tmp/caller") and seen == [Path("/tmp/caller")]


def test_two_asyncio_tasks_under_their_own_settings_each_read_their_own():
    async def operation(name: str, entered: asyncio.Event, other: asyncio.Event) -> Path:
        with settings_mod.using(_settings(name)):
            entered.set()
            await other.wait()
            return settings_mod.current().home

    async def both() -> list[Path]:
        a, b = asyncio.Event(), asyncio.Event()
        return list(await asyncio.gather(operation("a", a, b), operation("b", b, a)))

    assert asyncio.run(both()) == [Path("/tmp/a"), Path("/tmp/b")]


def test_every_pool_and_thread_of_the_plugin_copies_its_callers_context():
    """A pool or thread made anywhere else would run its work under the process's settings."""
    makers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "host/threads.py" or rel.startswith(ENGINE_SIDE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name in ("ThreadPoolExecutor", "Thread", "Timer"):
                    makers.append("%s:%d" % (rel, node.lineno))
    assert makers == [], "use host.threads.ContextPool or start_thread: %s" % makers
