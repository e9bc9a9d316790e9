"""The plugin's settings, read from the environment once, at the entry, into a frozen object.

Every ``COLDSNAP_*`` variable (and the few standard ones the plugin honours) is read
here and nowhere else. The CLI and the sparkrun strategy build the object when they
start and install it; the controller receives it with each operation and runs it under
:func:`using`; lower layers ask :func:`current`, which answers per thread and per asyncio
task. Tests build a :class:`Settings` and install it, or run under :func:`using`, instead of
changing the environment.

docs/user-guide.md ("Settings") lists each variable; keep the two in step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from sparkrun_coldsnap.errors import RequestError

OFF = ("0", "off", "no", "false")


def _path(value: str) -> Path:
    return Path(value).expanduser()


def default_page_fill_threads() -> int:
    """Eight threads fill a restored tree's memory, or one per CPU where the host has fewer:
    more than the CPUs only wait for each other."""
    return max(1, min(8, os.cpu_count() or 1))


def _whole_number(env: Mapping[str, str], name: str, default: int, *, least: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        raise RequestError("%s=%r is not a whole number of at least %d: set one, or unset it for %d" % (name, raw, least, default))
    return value


def _choice[T](env: Mapping[str, str], name: str, choices: Mapping[str, T], default: str) -> T:
    raw = env.get(name, "").strip().lower() or default
    if raw not in choices:
        raise RequestError("%s=%r is not one of %s: set one, or unset it for %s" % (name, env.get(name), ", ".join(choices), default))
    return choices[raw]


#: outside any user's home, so the path is the same on every host whoever runs the capture
ENGINE_CACHE_ROOT = Path("/var/cache/sparkrun-coldsnap/engine-caches")


@dataclass(frozen=True)
class Settings:
    #: ``COLDSNAP_HOME``: the private CRIU, engine environments, run state and the default store.
    home: Path
    #: ``COLDSNAP_STORE``: the capsule store when a recipe or ``--store`` names none.
    store: Path
    #: ``HF_HOME``: the Hugging Face cache sparkrun reads models from.
    hf_home: Path
    #: ``COLDSNAP_MEMORY_STAGING``: tmpfs directory for unpacked images (None: ``off``, stage on disk).
    memory_staging: Path | None = Path("/dev/shm")
    #: ``COLDSNAP_WEIGHTS_CACHE``: read the weights into the page cache during preparation.
    weights_cache: bool = True
    #: ``COLDSNAP_WEIGHTS_MEMORY``: copy a native payload into huge-page memory during preparation.
    weights_memory: bool = True
    #: ``COLDSNAP_PACKED_PAYLOAD``: keep a compressed copy of a native payload (made at capture) and
    #: copy the payload into memory from it: 69% of the bytes from the disk for bf16 weights, at
    #: the price of packing at capture (28 s for 13.9 GB on an H100 host) and that much more disk.
    packed_payload: bool = True
    #: ``COLDSNAP_FILES_CACHE``: read the files the captured tree maps into the page cache during preparation.
    files_cache: bool = True
    #: ``COLDSNAP_CACHE_IN_BACKGROUND``: preparation starts those reads and goes on without waiting for them.
    cache_in_background: bool = False
    #: ``COLDSNAP_ZERO_PAGES``: ``leave-out`` drops zero pages of private memory from dumps; ``keep`` keeps them.
    zero_pages: bool = True
    #: ``COLDSNAP_LAZY_PAGES``: memory on demand for the ``cpu`` driver's restores, with the fill off.
    lazy_pages: bool = True
    #: ``COLDSNAP_N610_LAZY_PAGES``: memory on demand for ``n610`` restores (off: slower on the GPU).
    n610_lazy_pages: bool = False
    #: ``COLDSNAP_PAGE_FILL``: threads that write a restored tree's big private memory areas after
    #: CRIU restored the rest (``n610``, ``cpu``); by default eight, or
    #: the host's CPUs where it has fewer (an 8B vLLM's criu restore went from 1.40 s to 0.58 s on
    #: a GPU host of 16 CPUs); 0: CRIU restores every page.
    page_fill_threads: int = field(default_factory=lambda: default_page_fill_threads())
    #: ``COLDSNAP_REGISTER_PIECE_MIB``: a native payload in memory is registered with CUDA in
    #: pieces of this many MiB while the pieces before are copied (0: all of it at once, which
    #: was faster on the H200).
    register_piece_mib: int = 0
    #: ``COLDSNAP_REGISTER_THREADS``: how many pieces are registered at the same time.
    register_threads: int = 4
    #: ``COLDSNAP_CUDA_RESTORE``: ``parallel`` restores the CUDA state of a tree's processes side
    #: by side, ``serial`` one after the other.
    cuda_restore_parallel: bool = True
    #: ``COLDSNAP_COMMUNICATORS``: ``keep`` carries a unit's NCCL communicators of several GPU
    #: ranks across the CUDA checkpoint; ``rebuild`` has the engine's workers destroy them before
    #: it and make them again after the restore (engines that can: vLLM, then run eagerly). On one
    #: GPU shared by two ranks neither came through on driver 580.159.04 (docs/gpu-ranks.md).
    rebuild_communicators: bool = False
    #: ``COLDSNAP_ENGINE_CACHE_ROOT``: where a template capture (n580) points its engine's compile
    #: and JIT caches, one folder per capture request beneath; the captured engine keeps the path
    #: in its memory, so a restoring host must name the same root (a restore refuses another).
    engine_cache_root: Path = ENGINE_CACHE_ROOT
    #: ``COLDSNAP_TEMPLATE_PRELOAD``: modules a template boundary imports (empty: the adapter's).
    template_preload: tuple[str, ...] = ()
    #: ``COLDSNAP_CRIU``: a CRIU command line to try before the system's and the private one.
    criu: tuple[str, ...] = ()
    #: ``COLDSNAP_CUDA_PYTHON``: the interpreter of the CUDA checkpoint helper (None: this one).
    cuda_python: str | None = None
    #: ``COLDSNAP_HOST_PYTHON``: the plugin's interpreter on the other hosts of a cluster, where
    #: the steps of a multi-host capture or restore run (None: this one's path, the same there).
    host_python: str | None = None
    #: ``COLDSNAP_DEBUG``: tracebacks and debug logs.
    debug: bool = False
    #: ``COLDSNAP_LIFECYCLE_DIR``: the lifecycle's workload records and locks (None: ``<home>/run/lifecycle``).
    lifecycle_dir: Path | None = None
    #: ``CUDA_VISIBLE_DEVICES`` of the restoring side: the GPUs a restored workload comes back on.
    cuda_visible_devices: str | None = None
    #: ``PYENV_ROOT``: where set-up looks for a Python 3.11 for the engine environment.
    pyenv_root: Path = field(default_factory=lambda: Path.home() / ".pyenv")
    #: registry credential files besides ``~/.docker/config.json`` (``DOCKER_CONFIG``,
    #: ``REGISTRY_AUTH_FILE``, ``$XDG_RUNTIME_DIR/containers/auth.json``), existing or not.
    credential_files: tuple[Path, ...] = ()
    #: ``COLDSNAP_DECRYPTION_KEY``: private keys (PEM paths, ``:``-separated) that open a capsule's
    #: encrypted layers as a restore unpacks them.
    decryption_keys: tuple[Path, ...] = ()
    #: the environment the plugin was started with: what host-process engines and the
    #: tools the plugin runs inherit.
    environ: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = dict(os.environ if environ is None else environ)
        home = _path(env["COLDSNAP_HOME"]) if env.get("COLDSNAP_HOME") else _path(env.get("XDG_DATA_HOME") or "~/.local/share") / "sparkrun-coldsnap"
        staging = env.get("COLDSNAP_MEMORY_STAGING", "/dev/shm")
        creds = []
        if env.get("DOCKER_CONFIG"):
            creds.append(_path(env["DOCKER_CONFIG"]) / "config.json")
        if env.get("REGISTRY_AUTH_FILE"):
            creds.append(_path(env["REGISTRY_AUTH_FILE"]))
        if env.get("XDG_RUNTIME_DIR"):
            creds.append(Path(env["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
        return cls(
            home=home,
            store=_path(env["COLDSNAP_STORE"]) if env.get("COLDSNAP_STORE") else home / "store",
            hf_home=_path(env["HF_HOME"]) if env.get("HF_HOME") else Path.home() / ".cache" / "huggingface",
            memory_staging=None if staging == "off" else Path(staging),
            weights_cache=env.get("COLDSNAP_WEIGHTS_CACHE", "auto").lower() not in OFF,
            weights_memory=env.get("COLDSNAP_WEIGHTS_MEMORY", "auto").lower() not in OFF,
            packed_payload=env.get("COLDSNAP_PACKED_PAYLOAD", "auto").lower() not in OFF,
            files_cache=env.get("COLDSNAP_FILES_CACHE", "auto").lower() not in OFF,
            cache_in_background=env.get("COLDSNAP_CACHE_IN_BACKGROUND") == "1",
            zero_pages=env.get("COLDSNAP_ZERO_PAGES", "leave-out").lower() not in ("keep", *OFF),
            lazy_pages=env.get("COLDSNAP_LAZY_PAGES", "1") != "0",
            n610_lazy_pages=env.get("COLDSNAP_N610_LAZY_PAGES") == "1",
            page_fill_threads=_whole_number(env, "COLDSNAP_PAGE_FILL", default_page_fill_threads(), least=0),
            register_piece_mib=_whole_number(env, "COLDSNAP_REGISTER_PIECE_MIB", 0, least=0),
            register_threads=_whole_number(env, "COLDSNAP_REGISTER_THREADS", 4, least=1),
            cuda_restore_parallel=_choice(env, "COLDSNAP_CUDA_RESTORE", {"parallel": True, "serial": False}, "parallel"),
            rebuild_communicators=_choice(env, "COLDSNAP_COMMUNICATORS", {"rebuild": True, "keep": False}, "keep"),
            engine_cache_root=_path(env["COLDSNAP_ENGINE_CACHE_ROOT"]) if env.get("COLDSNAP_ENGINE_CACHE_ROOT") else ENGINE_CACHE_ROOT,
            template_preload=tuple(m for m in env.get("COLDSNAP_TEMPLATE_PRELOAD", "").split(",") if m),
            criu=tuple(env.get("COLDSNAP_CRIU", "").split()),
            cuda_python=env.get("COLDSNAP_CUDA_PYTHON") or None,
            host_python=env.get("COLDSNAP_HOST_PYTHON") or None,
            debug=bool(env.get("COLDSNAP_DEBUG")),
            lifecycle_dir=_path(env["COLDSNAP_LIFECYCLE_DIR"]) if env.get("COLDSNAP_LIFECYCLE_DIR") else None,
            cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
            pyenv_root=_path(env["PYENV_ROOT"]) if env.get("PYENV_ROOT") else Path.home() / ".pyenv",
            credential_files=tuple(creds),
            decryption_keys=tuple(_path(p) for p in env.get("COLDSNAP_DECRYPTION_KEY", "").split(os.pathsep) if p),
            environ=MappingProxyType(env),
        )

    def replace(self, **changes: object) -> Settings:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def child_env(self, **extra: str) -> dict[str, str]:
        """The environment for a tool the plugin runs: ours, plus *extra*."""
        return {**self.environ, **extra}


#: the settings an operation runs under (:func:`using`): per thread and per asyncio task, so
#: two operations of one process, each on a thread of its own, read their own. A pool that
#: runs a caller's work runs it in a copy of the caller's context (``host/threads.py``).
_scoped: ContextVar[Settings | None] = ContextVar("coldsnap_settings", default=None)
#: the process's settings (:func:`install`): what a context with none of its own reads,
#: a thread started without a copy of its starter's context included.
_installed: Settings | None = None


def current() -> Settings:
    """The settings of this context, else the installed ones; a library caller that installed
    none gets the environment's, read once."""
    global _installed
    scoped = _scoped.get()
    if scoped is not None:
        return scoped
    if _installed is None:
        _installed = Settings.from_environ()
    return _installed


def install(settings: Settings) -> Settings:
    """Make *settings* the process's settings (the CLI and the sparkrun strategy do this at entry)."""
    global _installed
    _installed = settings
    _scoped.set(None)  # this context reads them from now on, not what a block around it set
    return settings


def forget() -> None:
    """Drop the installed settings; the next :func:`current` reads the environment again."""
    global _installed
    _installed = None
    _scoped.set(None)


@contextlib.contextmanager
def using(settings: Settings) -> Iterator[Settings]:
    """*settings* for the duration of the block in this thread or task, then the previous ones again."""
    token = _scoped.set(settings)
    try:
        yield settings
    finally:
        _scoped.reset(token)
