"""The host end of a multi-unit capture or restore: one step on the host a unit runs on.

The coordinator reaches a unit's host only through sparkrun's transport, and what touches
the unit's process tree has to run beside it: CRIU (``/proc``, sockets, mounts, the network
lock of that host's namespace), the files the tree maps, its images, the rank's records in
the host's own ``~/.cache/sparkrun``. Each step is this module run on that host,

    python -m sparkrun_coldsnap.integration.unit_agent VERB   < request.json   > answer.json

one JSON document in, one out; a failure answers ``{"error": ..., "code": ...}`` with exit
status 1, the error in one line. The plugin is installed on every host of a cluster, as
sparkrun is, at the same path (the coordinator calls its own interpreter's path there).

Verbs: ``root`` (the pid sparkrun's local executor recorded for a rank), ``files`` (what the
tree maps or holds open), ``dump`` (CRIU of the stopped tree at the cut, its connections to
the other hosts' units included; a capture's dump ends the tree, so CRIU keeps what it needs
of files deleted while open, such as a POSIX semaphore's ``link_remap`` in ``/dev/shm``,
which a dump that leaves the tree running removes again), ``pack`` (zero pages left out, layers written), ``admit``
(admission of one unit with this host's own fingerprint), ``inbox`` and ``stage`` (layers
received, verified and unpacked), ``restore``, ``adopt`` (a restored tree recorded as the
rank, so sparkrun's ``status``/``stop`` find it), ``io_uring_off``/``io_uring_back``,
``remove``, ``drop_page_cache`` (before a benchmark's sample).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparkrun_coldsnap.errors import ColdsnapError, RequestError

Verb = Callable[[dict[str, Any]], dict[str, Any]]


def _quiet(_: str) -> None:
    pass


def root(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.integration.records import registered_pid

    return {"pid": registered_pid(str(doc["name"]))}


def files(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.host import file_drift
    from sparkrun_coldsnap.host.process_tree import tree_pids
    from sparkrun_coldsnap.integration.records import local_record_paths

    # The rank's own log grows while it serves: a restore hands it the log again, not as captured.
    skip = [*(doc.get("skip") or ()), *([str(local_record_paths(str(doc["name"]))[1])] if doc.get("name") else [])]
    recorded = file_drift.record(tree_pids(int(doc["root_pid"])), skip=skip)
    return {"files": [f.model_dump(mode="json") for f in recorded]}


def dump(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.drivers import criu_tree
    from sparkrun_coldsnap.drivers.criu_tool import Criu

    image = criu_tree.dump(
        Criu.locate(), int(doc["root_pid"]), Path(doc["images"]), unit=str(doc["unit"]), host=str(doc["host"]), driver=str(doc["driver"]),
        progress=_quiet, leave_running=bool(doc.get("leave_running")), peers=True,
    )  # fmt: skip
    return {"image": image.model_dump(mode="json")}


def pack(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap import extensions
    from sparkrun_coldsnap.capsule.pack import pack_unit

    images, out = Path(doc["images"]), Path(doc["out"])
    compacted = extensions.registry().driver(str(doc["driver"])).compact_images(images) if doc.get("zero_pages", True) else None
    image_bytes = sum(f.stat().st_size for f in images.rglob("*") if f.is_file())
    out.mkdir(parents=True, exist_ok=True)
    layers = pack_unit(images, str(doc["unit"]), out)
    return {
        "image_bytes": image_bytes,
        "zero_pages": compacted,
        "layers": [{"path": str(l.path), "digest": l.digest, "size": l.size, "media_type": l.media_type, "annotations": l.annotations} for l in layers],
    }


def admit(doc: dict[str, Any]) -> dict[str, Any]:
    """Admission of one unit of a capsule on this host: its fingerprint, its captured PIDs and
    shared files, its files, the model files here (what the rank running now holds is freed
    by its eviction, so it does not count)."""
    from sparkrun_coldsnap.capsule.config import CapsuleConfig
    from sparkrun_coldsnap.compat.admission import admission
    from sparkrun_coldsnap.controller.common import resolve
    from sparkrun_coldsnap.documents import settings as settings_mod
    from sparkrun_coldsnap.documents.request import RestoreRequest
    from sparkrun_coldsnap.drivers import criu_tree
    from sparkrun_coldsnap.host.process_tree import tree_pids

    cfg = CapsuleConfig.model_validate(doc["config"])
    req = RestoreRequest.model_validate(doc["request"])
    unit = next(u for u in cfg.units if u.name == doc["unit"])
    r = resolve(req.workload, settings_mod.current())
    here = r.fingerprint(req.workload, r.driver.checkpoint_tool_version())
    replacing = frozenset(p for _, leader in _recorded(str(doc["pattern"])) for p in tree_pids(leader))
    problems, _ = admission(cfg.model_copy(update={"units": (unit,)}), req, here, r.driver, r.adapter, replacing=replacing)
    # Restored into this host's namespaces (the ranks reach each other at the captured
    # addresses): the captured PIDs and shared files must be free here.
    problems += criu_tree.restore_problems(unit, replacing=replacing)
    return {"problems": problems}


def _recorded(pattern: str) -> list[tuple[str, int]]:
    """The ranks sparkrun's local executor recorded here under names matching *pattern* whose
    process group leader runs (a restored tree included), as (name, pid).

    A rank's name holds its run's placement token, which another run of the same recipe need
    not share: the workload a restore replaces is found by the recipe's part of the name."""
    import os

    import psutil

    from sparkrun_coldsnap.integration.records import local_record_paths

    pids = local_record_paths("x")[0].parent
    out = []
    for pidfile in sorted(pids.glob(pattern + ".pid")):
        try:
            pid = int(pidfile.read_text().strip())
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and os.getpgid(pid) == pid:
                out.append((pidfile.name[: -len(".pid")], pid))
        except (OSError, ValueError, psutil.Error):
            continue
    return out


def recorded(doc: dict[str, Any]) -> dict[str, Any]:
    return {"ranks": [{"name": n, "pid": p} for n, p in _recorded(str(doc["pattern"]))]}


def inbox(doc: dict[str, Any]) -> dict[str, Any]:
    """A private directory for the layers about to be sent here."""
    from sparkrun_coldsnap.capsule.store import CapsuleStore
    from sparkrun_coldsnap.host import paths
    from sparkrun_coldsnap.host.atomic import owned_prefix

    base = paths.run_dir() / "units"
    base.mkdir(parents=True, exist_ok=True)
    received = CapsuleStore(Path(tempfile.mkdtemp(prefix=owned_prefix("inbox-"), dir=base)))
    received.blobs.mkdir(parents=True)
    # Laid out as a store's blobs are: each layer is verified as it is read, as from a store.
    return {"path": str(received.root), "blobs": str(received.blobs)}


def stage(doc: dict[str, Any]) -> dict[str, Any]:
    """Verify and unpack the layers sent to ``inbox`` (memory-backed staging when there is
    room); the layers received are removed once unpacked."""
    from sparkrun_coldsnap.capsule.pack import unpack_layer
    from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor
    from sparkrun_coldsnap.host import paths
    from sparkrun_coldsnap.host.atomic import owned_prefix

    received = Path(doc["inbox"])
    descs = [Descriptor.from_json(d) for d in doc["layers"]]
    unpacked = int(doc.get("unpacked_bytes") or 0)
    memory = paths.memory_staging(unpacked)
    staging = paths.new_memory_staging(memory, owned_prefix("restore-")) if memory is not None else Path(tempfile.mkdtemp(prefix=owned_prefix("restore-"), dir=received.parent))
    try:
        written = sum(unpack_layer(CapsuleStore(received), d, staging / "units") for d in descs)
    except BaseException:
        paths.remove_staging(staging)
        raise
    finally:
        paths.remove_staging(received)
    return {"staging": str(staging), "images": str(staging / "units" / str(doc["unit"])), "bytes": written}


def restore(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.drivers import criu_tree
    from sparkrun_coldsnap.drivers.base import UnitImage
    from sparkrun_coldsnap.drivers.criu_tool import Criu
    from sparkrun_coldsnap.errors import RestoreError
    from sparkrun_coldsnap.integration.records import local_record_paths

    unit = UnitImage.model_validate(doc["image"])
    # The dumped tree's processes must be gone, not zombies waiting for the host's init.
    held = criu_tree.pid_problems(unit.pids, zombie_wait=float(doc.get("zombie_wait", 30.0)))
    if held:
        raise RestoreError("; ".join(held))
    _, log_path = local_record_paths(str(doc["name"]))  # the rank's own log: sparkrun logs reads it
    pid, _ = criu_tree.restore(Criu.locate(), unit, Path(doc["images"]), log_path=log_path, progress=_quiet)
    return {"pid": pid}


def adopt(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.integration.records import register_local

    return {"pidfile": str(register_local(str(doc["name"]), int(doc["pid"])))}


def io_uring_off(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.host.iouring import hold_off

    return {"previous": hold_off()}


def io_uring_back(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.host.iouring import put_back_after_crash

    return {"restored": put_back_after_crash()}


def drop_page_cache(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.weights.page_cache import drop

    drop()
    return {}


def remove(doc: dict[str, Any]) -> dict[str, Any]:
    from sparkrun_coldsnap.host import paths

    for p in doc.get("paths") or ():
        paths.remove_staging(Path(p))
    return {}


VERBS: dict[str, Verb] = {
    "root": root, "recorded": recorded, "files": files, "dump": dump, "pack": pack, "admit": admit, "inbox": inbox, "stage": stage,
    "restore": restore, "adopt": adopt, "io_uring_off": io_uring_off, "io_uring_back": io_uring_back, "remove": remove,
    "drop_page_cache": drop_page_cache,
}  # fmt: skip


def main(argv: list[str]) -> int:
    try:
        if len(argv) != 1 or argv[0] not in VERBS:
            raise RequestError("unit agent: name one verb of %s" % ", ".join(sorted(VERBS)))
        answer = VERBS[argv[0]](json.loads(sys.stdin.read() or "{}"))
    except ColdsnapError as err:
        print(json.dumps({"error": err.message, "code": err.code}))
        return 1
    except Exception as err:  # noqa: BLE001 - the coordinator reports it, naming the host
        print(json.dumps({"error": "%s: %s" % (type(err).__name__, err), "code": "agent.unexpected"}))
        return 1
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
