"""The weights of a workload on several hosts, when they leave the capsule (GPU drivers): the
native payload every host's ranks write at capture, the weight path a restore takes (decided
on every host before the workload it replaces stops), and the hydration through rank 0.

The engine is asked through rank 0 only: vLLM's ``collective_rpc`` reaches every worker on
every host, each writing or reading its own ``rank-N`` files on its own host
(``weights/native_parts.py``), and its sleep and wake calls release and refill every rank.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from sparkrun_coldsnap.documents.capsule_config import CapsuleConfig, NativePayload
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder, Weights
from sparkrun_coldsnap.documents.request import CaptureRequest, LaunchUnit, RestoreRequest
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import CaptureError, ColdsnapError, CompatibilityError, EngineError
from sparkrun_coldsnap.launch.remote import UnitHosts
from sparkrun_coldsnap.progress import Progress
from sparkrun_coldsnap.units.resolved import Resolved
from sparkrun_coldsnap.units.steps import AdmitAnswer, NativePartStep, NativePlaceStep, NativeStagingStep, RemoveStep
from sparkrun_coldsnap.weights import native_parts, weight_paths


def export_native(
    r: Resolved, req: CaptureRequest, hosts: UnitHosts, units: Sequence[LaunchUnit], endpoint: Endpoint, rb: ReceiptBuilder, progress: Progress,
) -> tuple[NativePayload | None, dict[str, list[str]]]:  # fmt: skip
    """Have every rank write its part of the payload on its host, through rank 0; (the whole
    payload's record, the files each unit's host holds). With ``weights: auto`` a failure is
    noted and the restores take the recovery path; with ``native`` it fails the capture."""
    staged: dict[str, str] = {}
    try:
        with rb.phase("native_export"), progress.waiting("writing the native weight payload on every host"):
            token = secrets.token_hex(8)
            staged = {u.name: hosts.call(u, NativeStagingStep(token=token), timeout=60).path for u in units}
            where = sorted(set(staged.values()))
            if len(where) != 1:
                raise EngineError("the hosts keep native payloads under different paths (%s): the engine hands every rank one path; give every host the same COLDSNAP_HOME" % ", ".join(where))
            reports = r.adapter.export_native(endpoint, where[0])
            parts = {u.name: hosts.call(u, NativePartStep(path=staged[u.name]), timeout=900).files for u in units}
            record = native_parts.combine(parts)
            for u in units:  # one host after another: hosts that share a filesystem share the staging directory
                names = [f.name for f in parts[u.name]]
                hosts.call(u, NativePlaceStep(path=staged[u.name], record=record, names=tuple(names)), timeout=300)
    except ColdsnapError as err:
        for u in units:
            if u.name in staged:
                try:
                    hosts.call(u, RemoveStep(paths=(staged[u.name],)), timeout=300)
                except ColdsnapError:
                    pass  # a staging directory left under the payload root is ignored and freed by gc
        if req.workload.weights == "native":
            raise CaptureError("writing the native weight payload failed: %s; capture with weights: auto or recovery" % err) from err
        rb.details["native_export_error"] = str(err)
        progress.note("no native weight payload (%s): restores will use recovery" % err)
        return None, {}
    rb.details["native_export"] = list(reports)
    rb.details["native_parts"] = {name: [f.name for f in held] for name, held in parts.items()}
    return record, {name: [f.name for f in held] for name, held in parts.items()}


def choose(req: RestoreRequest, units: Sequence[LaunchUnit], answers: Mapping[str, AdmitAnswer]) -> weight_paths.WeightChoice | None:
    """One weight path for every unit, from what each host's admission found there (None: the
    weights are in the images). Native only when every host holds its part, at one path."""
    found = {u.name: answers[u.name].weights for u in units}
    if all(f is None for f in found.values()):
        return None
    if all(f and f.path == "native" for f in found.values()):
        dirs = sorted({str(f.native_dir) for f in found.values() if f})
        if len(dirs) == 1:
            return weight_paths.WeightChoice("native", Path(dirs[0]))
        why = "the hosts hold the native payload under different paths (%s) and the engine hands every rank one path" % ", ".join(dirs)
        if req.workload.weights == "native":
            raise CompatibilityError("weights: native: %s; give every host the same COLDSNAP_HOME, or restore with weights: auto or recovery" % why)
        return weight_paths.WeightChoice("recovery", note=why)
    notes = ["unit %s on host %s: %s" % (u.name, u.host, f.note) for u in units if (f := found[u.name]) and f.note]
    return weight_paths.WeightChoice("recovery", note=notes[0] if notes else None)


def hydrate(r: Resolved, req: RestoreRequest, cfg: CapsuleConfig, choice: weight_paths.WeightChoice, endpoint: Endpoint, rb: ReceiptBuilder, progress: Progress) -> None:
    """Every rank's weights back, asked of rank 0 (it wakes and fills every worker)."""
    with rb.phase("hydrate"), progress.waiting("hydrating the weights of every rank through rank 0 (%s)" % choice.path):
        h = r.adapter.hydrate(endpoint, path=choice.path, model_dir=req.workload.model.path or "", native_dir=str(choice.native_dir) if choice.native_dir else None)
    source = weight_paths.source_files(cfg, choice.path)
    rb.weights = Weights(path=h.path, seconds=round(h.seconds, 4), files=len(source), bytes=sum(f.size for f in source), note=choice.note)
    if h.details:
        rb.details["hydrate"] = list(h.details)
