"""A capsule is bound to the exact weights it was captured with.

The recipe pins ``model_revision``, but the engine only learns it from its serve
command: given a bare repo id it resolves whatever the Hugging Face cache's
``refs/main`` names, which may be other weights than the pinned snapshot whose
files the capsule records. So before an engine is started for a capture (or a
vanilla start), its command must name the pinned revision (or the pinned
snapshot's directory itself); after the checkpoint, the model files the engine
mapped or held open must be files of that snapshot, and the snapshot's files must
still have the digests recorded before the launch.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable
from pathlib import Path

from sparkrun_coldsnap.documents.request import Workload
from sparkrun_coldsnap.engines.base import EngineAdapter, flag_value


def _model_argument(command: str, adapter: EngineAdapter) -> str | None:
    for flag in adapter.model_flags:
        value = flag_value(command, flag)
        if value is not None:
            return value
    try:
        argv = shlex.split(command)
    except ValueError:
        return None
    # `vllm serve MODEL` / `sglang serve MODEL`: the model is the first positional after serve.
    if "serve" in argv:
        rest = argv[argv.index("serve") + 1 :]
        if rest and not rest[0].startswith("-"):
            return rest[0]
    return None


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except OSError:
        return False


def launch_problem(workload: Workload, adapter: EngineAdapter) -> str | None:
    """Why the serve command would not load exactly the pinned revision (None: it does)."""
    command, model = workload.launch.command, workload.model
    flag = adapter.revision_flag
    given = flag_value(command, flag)
    if given is not None:
        if given != model.revision:
            return "the serve command passes %s %s but model_revision pins %s: make them agree (pass %s {model_revision})" % (flag, given, model.revision, flag)
        return None
    arg = _model_argument(command, adapter)
    if arg is not None and arg.startswith("/"):
        # A directory named outright: it must be the pinned snapshot's own.
        if model.path and _same_dir(arg, model.path):
            return None
        return "the serve command loads the model from %s, not from the pinned snapshot of %s@%s (%s): name that directory or pass %s {model_revision}" % (
            arg, model.id, model.revision, model.path or "not on this host", flag)  # fmt: skip
    return "the serve command does not pass model_revision to the engine, which would load whatever the model cache's refs/main names: add `%s {model_revision}` to the recipe's command" % flag


def snapshot_files(model_dir: Path | str) -> dict[str, str]:
    """The pinned snapshot's files as the engine opens them (real paths, blobs included) -> their names."""
    root = Path(model_dir)
    out: dict[str, str] = {}
    for p in root.rglob("*"):
        if p.is_file():
            out[os.path.realpath(p)] = p.relative_to(root).as_posix()
    return out


def foreign_model_files(opened: Iterable[str], model_dir: Path | str) -> list[str]:
    """Files of the model's cache (``models--ORG--NAME/``) the engine used that are not the pinned snapshot's."""
    root = Path(model_dir)
    # .../hub/models--ORG--NAME/snapshots/REV: the repository's cache is two levels up.
    repo = os.path.realpath(root.parent.parent) if root.parent.name == "snapshots" else os.path.realpath(root)
    pinned = snapshot_files(root)
    out = []
    for path in opened:
        real = os.path.realpath(path)
        if (real == repo or real.startswith(repo + os.sep)) and real not in pinned:
            out.append(path)
    return sorted(set(out))
