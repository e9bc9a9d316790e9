"""Local engine environments: what an image is for a container workload.

The engine runs in its own Python environment, apart from the plugin's, as it
would in a container image. ``sparkrun coldsnap setup`` installs them under
``$COLDSNAP_HOME/engines/<name>``; a recipe names one with
``coldsnap.engine_env`` and the launch puts its ``bin`` first on PATH. Its
identity (the digest of every installed distribution and version) is recorded
at capture the way an image digest would be.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from sparkrun_coldsnap.digests import canonical_json, sha256_bytes
from sparkrun_coldsnap.errors import RequestError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.runner import run

# ``python -c`` puts the working directory first on sys.path: a package's metadata lying there
# (a source checkout's egg-info) would count as installed, and the engine's identity would
# depend on where the plugin was started (another host's agent starts in its home).
_FACTS = r"""
import json, sys, importlib.metadata as m
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
pk = {}
for d in m.distributions():
    name = (d.metadata["Name"] or "").lower().replace("_", "-")
    if name:
        pk[name] = d.version
print(json.dumps({"python": "%d.%d.%d" % sys.version_info[:3], "packages": pk}))
"""


@dataclass(frozen=True)
class EngineFacts:
    python_version: str
    packages: dict[str, str]

    @property
    def digest(self) -> str:
        return sha256_bytes(canonical_json(self.packages))

    @property
    def torch_version(self) -> str | None:
        return self.packages.get("torch")


@dataclass(frozen=True)
class EngineEnv:
    name: str
    root: Path

    @classmethod
    def named(cls, name: str) -> EngineEnv:
        env = cls(name, paths.engine_env_dir(name))
        if not env.python.exists():
            known = sorted(p.name for p in paths.engines_dir().iterdir()) if paths.engines_dir().is_dir() else []
            raise RequestError("engine environment %r is not installed at %s (installed: %s): run `sparkrun coldsnap setup --engine %s`" % (name, env.root, ", ".join(known) or "none", name))
        return env

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    def apply(self, env: dict[str, str]) -> dict[str, str]:
        """*env* with this environment's bin first on PATH."""
        out = dict(env)
        out["PATH"] = "%s:%s" % (self.bin, out.get("PATH", "/usr/local/bin:/usr/bin:/bin"))
        out["VIRTUAL_ENV"] = str(self.root)
        return out

    def facts(self) -> EngineFacts:
        return _facts(str(self.python))


@functools.lru_cache(maxsize=8)
def _facts(python: str, pythonpath: str | None = None) -> EngineFacts:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = run([python, "-c", _FACTS], timeout=120, env=env, what="engine environment probe")
    doc = json.loads(out.stdout)
    return EngineFacts(doc["python"], dict(sorted(doc["packages"].items())))


def _interpreter(command: str) -> str | None:
    try:
        exe = shlex.split(command)[0]
    except (ValueError, IndexError):
        return None
    return exe if "python" in os.path.basename(exe) else None


def image_facts(image: str, command: str) -> EngineFacts | None:
    """Facts of the interpreter a container command starts, read inside *image* (``name@id``).

    An image id names its content, so the answer is kept under ``run/image-facts`` and the
    container (a second or two) runs once per image and interpreter.
    """
    from sparkrun_coldsnap.host.atomic import write_bytes

    exe = _interpreter(command)
    if exe is None:
        return None
    image_id = image.split("@", 1)[-1]
    cache = paths.run_dir() / "image-facts" / ("%s-%s.json" % (image_id.split(":")[-1], sha256_bytes(exe.encode()).split(":")[-1][:12]))
    try:
        doc = json.loads(cache.read_text())
    except (OSError, ValueError):
        try:
            out = run(["docker", "run", "--rm", "--network=none", "--entrypoint", exe, image_id, "-c", _FACTS], timeout=180, check=False, what="engine facts in the image")
        except Exception:  # noqa: BLE001 - without facts the image digest still pins the engine
            return None
        if out.returncode != 0:
            return None
        try:
            doc = json.loads(out.stdout)
        except ValueError:
            return None
        write_bytes(cache, json.dumps(doc).encode())
    return EngineFacts(doc["python"], dict(sorted(doc["packages"].items())))


def command_facts(command: str, env: dict[str, str]) -> EngineFacts | None:
    """Facts of the interpreter a host-process command starts (``python -m ...``), with its PYTHONPATH."""
    exe = _interpreter(command)
    if exe is None:
        return None
    path = shutil.which(exe, path=env.get("PATH") or os.environ.get("PATH"))
    if not path:
        return None
    try:
        return _facts(path, env.get("PYTHONPATH"))
    except Exception:  # noqa: BLE001 - without facts, admission compares fewer of them
        return None
