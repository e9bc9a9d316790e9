"""The vanilla-versus-restore benchmark of a workload placed as several units, one per host.

Measured as :mod:`sparkrun_coldsnap.bench` measures one unit, over the hosts the workload was
placed on (``launch/remote.UnitHosts``): before every sample the page cache is dropped on
every unit's host; a vanilla sample starts every rank (head first, the workers once the head
listens) and waits for the first non-empty streamed token of a validated reply through rank
0, the clock running from the first launch; a restore sample prepares first (topology,
admission on every host, each unit's layers staged on its host: reported apart, off the
clock, as ``sparkrun run`` does it before eviction), then the clock runs from the start of
the restore of every unit to the first token of a reply through rank 0 that matches the one
recorded at capture. Every sample stops every unit it started before the next begins.
"""

from __future__ import annotations

import time

from sparkrun_coldsnap.bench import VANILLA, Sample, document, phase_bytes
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.controller.common import Attempt, resolve
from sparkrun_coldsnap.controller.units import ordered, start_units
from sparkrun_coldsnap.controller.units_restore import activate_units, prepare_units
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.launch.remote import UnitHosts
from sparkrun_coldsnap.progress import Progress

#: seconds given to a stopped rank's memory to go back before the next start
SETTLE = 1.0


def drop_page_caches(hosts: UnitHosts, req: RestoreRequest) -> None:
    """The page cache dropped on every host a unit runs on (each host once)."""
    seen: set[str] = set()
    for u in ordered(req.workload):
        if u.host not in seen:
            seen.add(u.host)
            hosts.agent(u, "drop_page_cache", {}, timeout=300)


def _stop(hosts: UnitHosts) -> None:
    problems = hosts.stop_all()
    if problems:
        raise ToolError("stopping the units of a sample failed: %s" % "; ".join(problems))
    time.sleep(SETTLE)


def vanilla_sample(req: RestoreRequest, hosts: UnitHosts, *, index: int, init_port: int, progress: Progress) -> Sample:
    settings = settings_mod.current()
    rb = ReceiptBuilder("start", request_sha256=req.digest())
    with Attempt(rb, stop=hosts.stop_all, told="every rank started has been stopped"):
        validation, _ = start_units(resolve(req.workload, settings), req, hosts, rb, progress, init_port=init_port)
    receipt = rb.finish("succeeded")
    _stop(hosts)
    return Sample(VANILLA, index, validation.ttft_seconds or 0.0, phases={p.name: p.seconds for p in receipt.phases}, validated=validation.passed)


def restore_sample(req: RestoreRequest, hosts: UnitHosts, *, store: CapsuleStore, index: int, progress: Progress) -> Sample:
    prepared = prepare_units(req, hosts, store=store, progress=progress)
    outcome = activate_units(prepared, progress=progress)
    _stop(hosts)
    receipt = outcome.receipt
    return Sample(
        req.workload.driver, index, outcome.ttft_seconds or 0.0, prepare_seconds=prepared.prepare_seconds,
        phases={p.name: p.seconds for p in receipt.phases}, validated=bool(receipt.validation and receipt.validation.passed),
        bytes=phase_bytes(prepared.capsule, receipt), first_token_floor=prepared.capsule.config.validation.request_ttft_seconds,
        notes={"units": receipt.details.get("units", {})},
    )  # fmt: skip


def run(req: RestoreRequest, hosts: UnitHosts, *, store: CapsuleStore, init_port: int, samples: int, progress: Progress, drop_cache: bool = True) -> dict:
    """Alternate a vanilla start of every unit and a restore of every unit, *samples* times."""
    results: list[Sample] = []
    units = ordered(req.workload)
    for i in range(samples):
        if drop_cache:
            drop_page_caches(hosts, req)
        progress.step("sample %d/%d: vanilla start of %d units" % (i + 1, samples, len(units)))
        results.append(vanilla_sample(req, hosts, index=i, init_port=init_port, progress=progress))
        progress.note("vanilla: first token after %.2f s" % results[-1].ttft_seconds)
        if drop_cache:
            drop_page_caches(hosts, req)
        progress.step("sample %d/%d: restore of %d units" % (i + 1, samples, len(units)))
        results.append(restore_sample(req, hosts, store=store, index=i, progress=progress))
        progress.note("restore: first token after %.2f s (prepared in %.2f s before the clock)" % (results[-1].ttft_seconds, results[-1].prepare_seconds or 0.0))
    capsules = {req.workload.driver: {"ref": req.capsule.ref, "digest": store.resolve(req.capsule.ref).descriptor.digest}}
    placed = [{"unit": u.name, "rank": u.rank, "host": u.host} for u in units]
    return document(req, results, capsules=capsules, drop_cache=drop_cache, extra={"units": placed})
