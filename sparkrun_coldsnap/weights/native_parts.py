"""A native weight payload written by ranks on several hosts: each host keeps the part its own
ranks wrote (``rank-N.bin``, ``rank-N.json``), all under the one payload's digest.

vLLM's ``collective_rpc`` hands every worker the same directory path, and each worker writes
there on its own host. So every host makes a staging directory at one path (the coordinator
picks its name), the engine writes into it through rank 0, each host records the files it
holds, the coordinator joins the records into one payload (whose digest names it on every
host, as a one-host payload's does), and each host moves its part to that address. Where the
hosts share a filesystem each sees every file: the first host's move places them all, the
others find their part already in place.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from sparkrun_coldsnap.digests import canonical_json, sha256_bytes, short
from sparkrun_coldsnap.documents.capsule_config import ModelFile, NativePayload
from sparkrun_coldsnap.errors import EngineError, RequestError
from sparkrun_coldsnap.weights import model_files, native_payload

_TOKEN = re.compile(r"^[0-9a-f]{8,64}$")


def staging(token: str) -> Path:
    """The staging directory named by *token* under this host's payload root (made, or already
    made by a host sharing this filesystem)."""
    if not _TOKEN.match(token):
        raise RequestError("native payload staging token %r is not hexadecimal: a coordinator bug" % token)
    path = native_payload.root() / (".staging-" + token)
    path.mkdir(parents=True, exist_ok=True)
    return path


def part(path: Path) -> tuple[ModelFile, ...]:
    """The files of the payload this host holds in staging directory *path* (none: nothing written here)."""
    return model_files.record(path) if path.is_dir() else ()


def combine(parts: Mapping[str, Sequence[ModelFile]]) -> NativePayload:
    """One payload of every host's part (*parts* by unit); a file two hosts hold must be the
    same file (a shared filesystem), else the ranks wrote under one name twice."""
    files: dict[str, ModelFile] = {}
    for unit, held in parts.items():
        for f in held:
            if f.name in files and files[f.name] != f:
                raise EngineError("two hosts wrote different native payload files named %s (unit %s): the ranks' numbers collide; capture with weights: recovery" % (f.name, unit))
            files[f.name] = f
    if not files:
        raise EngineError("the engine wrote no native payload files on any host")
    ordered = tuple(files[name] for name in sorted(files))
    # The same digest a one-host payload of these files has (native_payload.seal).
    return NativePayload(digest=sha256_bytes(canonical_json([f.model_dump(mode="json") for f in ordered])), files=ordered)


def only(record: NativePayload, names: Sequence[str]) -> NativePayload:
    """The part of *record* one host holds, under the whole payload's digest (its directory)."""
    return NativePayload(digest=record.digest, files=tuple(f for f in record.files if f.name in set(names)))


def place(path: Path, record: NativePayload, names: Sequence[str]) -> Path:
    """Move this host's part from staging *path* to the payload's address; that directory.

    A part already there and intact (a shared filesystem, or an earlier capture of the same
    tensors) is kept and the staged copy dropped."""
    mine = only(record, names)
    final = native_payload.directory(record)
    if path.is_dir() and not final.is_dir():
        os.chmod(path, 0o755)
        os.rename(path, final)
    shutil.rmtree(path, ignore_errors=True)
    problems = native_payload.problems(mine)
    if problems:
        raise EngineError("placing the native payload %s on this host: %s" % (short(record.digest), problems[0]))
    return final
