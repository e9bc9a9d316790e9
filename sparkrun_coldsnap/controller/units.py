"""A workload placed as several launch units, one per host: captured at one cut, restored together.

Capture: every host answers, and its driver can capture there, before anything starts; the
ranks are started on their hosts (head first, workers once the head listens on the rendezvous
port) with what the driver needs of their launch, and validated through rank 0; where the
weights leave the capsule (GPU drivers) every rank writes its native payload on its host and
the engine releases its memory, both asked of rank 0; every unit's files are recorded on its
host; the units are checkpointed at one consistent cut (``cut.checkpoint_units``: every
unit's devices locked, then checkpointed, then every unit stopped and dumped) and end there;
each host leaves its zero pages out and packs its own unit's layers, which are gathered
(digests checked) into the one store; the capsule is published only when every unit's layers
are in.

Restore: the capsule's topology must be the run's (host count, each rank on the host it was
captured on: the ranks' connections come back as they were, to the captured addresses);
every unit is admitted on its own host with that host's fingerprint; each host receives and
unpacks its unit's layers; all before anything is stopped. Then the workload being replaced
is stopped, every unit is restored on its host at once, still stopped at the cut, recorded as
its rank (sparkrun's ``status``/``stop`` see it) and continued (``cut.restore_units``: then
every unit's devices given back, then unlocked), the weights brought back through rank 0, and
the reply through rank 0 is checked against the one recorded at capture.

Any failure stops what this operation started on every host and removes what it staged; a
failure before the restore leaves the workload being replaced as it was.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule.pack import PackedLayer
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.compat.fingerprint import compare
from sparkrun_coldsnap.controller import units_weights
from sparkrun_coldsnap.controller.admit import admit_snapshot, resolve_across_hosts
from sparkrun_coldsnap.controller.capture import CaptureOutcome, capsule_config
from sparkrun_coldsnap.controller.common import Attempt, finish, validate
from sparkrun_coldsnap.controller.cut import UnitOnHost, checkpoint_units, on_every_unit
from sparkrun_coldsnap.controller.units_agent import AgentCut, AgentDevices
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.capsule_config import NativePayload
from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.documents.fingerprint import Fingerprint
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder, Validation
from sparkrun_coldsnap.documents.request import CaptureRequest, LaunchUnit, RestoreRequest, Workload
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import CaptureError, ColdsnapError, ValidationError
from sparkrun_coldsnap.host import iouring
from sparkrun_coldsnap.host.file_drift import RecordedFile
from sparkrun_coldsnap.launch.remote import UnitHosts
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.units.resolved import Resolved
from sparkrun_coldsnap.units.steps import CaptureFactsStep, FilesStep, InboxStep, IoUringBackStep, IoUringOffStep, PackStep, RemoveStep
from sparkrun_coldsnap.weights import model_files, weight_paths


def ordered(w: Workload) -> list[LaunchUnit]:
    return sorted(w.topology.units, key=lambda u: u.rank)


def rank0_endpoint(r: Resolved, w: Workload, hosts: UnitHosts) -> Endpoint:
    head = ordered(w)[0]
    e = r.adapter.endpoint(w.launch.command, w.model.id, w.launch.port)
    return Endpoint(e.base_url.replace("127.0.0.1", hosts.head_address(head), 1), e.served_model)


@contextlib.contextmanager
def _io_uring_off(hosts: UnitHosts, units: Sequence[LaunchUnit]):
    """io_uring off on every unit's host while their engines start and are dumped; each host
    counts this capture as one holder, known by its token, beside any capture of its own."""
    token = uuid.uuid4().hex
    by = iouring.coordinator()  # a host where this process runs ends the hold with it, should it be killed outright
    asked: list[LaunchUnit] = []
    try:
        for u in units:
            asked.append(u)  # before the call: one that took the hold but whose answer was lost is let go too
            hosts.call(u, IoUringOffStep(token=token, coordinator=by), timeout=60)
        yield
    finally:
        for u in reversed(asked):
            with contextlib.suppress(ColdsnapError):
                hosts.call(u, IoUringBackStep(token=token), timeout=60)


Launch = Callable[[LaunchUnit], tuple[str, dict[str, str]]]


def recipe_launch(w: Workload) -> Launch:
    """Each unit's command and environment as the recipe and placement give them."""
    return lambda u: (u.command or w.launch.command, {**w.launch.env, **u.env})


def start_units(
    r: Resolved, req: CaptureRequest | RestoreRequest, hosts: UnitHosts, rb: ReceiptBuilder, progress: Progress, *, init_port: int, launch: Launch | None = None,
) -> tuple[Validation, float]:  # fmt: skip
    """Every unit started on its host (head first), ready and validated through rank 0; (validation, t0).

    *launch* gives each unit's command and environment (default: the recipe's)."""
    w = req.workload
    units = ordered(w)
    launch = launch or recipe_launch(w)
    t0 = time.monotonic()
    for u in units:
        if u.rank == 1:
            with rb.phase("rendezvous.wait"):
                progress.step("waiting for the head on %s to open port %d" % (units[0].host, init_port))
                hosts.wait_rendezvous(units[0], init_port)
        progress.step("starting %s on %s" % (u.name, u.host))
        with rb.phase("launch.%s" % u.name):
            hosts.start(u, *launch(u))
    endpoint = rank0_endpoint(r, w, hosts)
    with rb.phase("ready"), progress.waiting("waiting for rank 0 to answer on %s" % endpoint.base_url):
        try:
            r.adapter.wait_ready(endpoint, alive=hosts.alive, timeout=req.ready_timeout_seconds)
        except ColdsnapError as err:
            dead = hosts.dead_units()
            raise type(err)("%s%s" % (err.message, " (%s)" % "; ".join(dead) if dead else "")) from err
    with rb.phase("validate"):
        validation = validate(r, endpoint, req, t0, req.validation.expected_reply)
    rb.validation = validation
    if not validation.passed:
        raise ValidationError("rank 0 on %s replied %r, the recipe expects %r: fix coldsnap.validation.expected_reply" % (units[0].host, validation.reply, validation.expected_reply))
    return validation, t0


def capture_units(
    req: CaptureRequest, hosts: UnitHosts, *, store: CapsuleStore, init_port: int, settings: Settings | None = None, progress: Progress = QUIET,
) -> CaptureOutcome:  # fmt: skip
    """Start every unit on its host, validate through rank 0, checkpoint all at one cut, publish."""
    settings = settings or settings_mod.current()
    rb = ReceiptBuilder("capture", request_sha256=req.digest())
    rb.capsule_ref, rb.secrets = req.capsule.ref, req.workload.secret_values()
    w = req.workload
    units = ordered(w)
    by_name = {u.name: u for u in units}
    told = "every unit started has been stopped and nothing was published"
    with settings_mod.using(settings), Attempt(rb, stop=hosts.stop_all, told=told) as attempt:
        with rb.phase("admission"):
            r = resolve_across_hosts(w, settings)
            model_dir = admit_snapshot(w, r.adapter)
            native_wanted = weight_paths.writes_native(w, r.driver, r.adapter)
            launches = capture_launches(r, w, units, rb, native_wanted=native_wanted)  # a refused setting stops it here, before anything starts
            hosts.check_reachable(units)
            fingerprint = _capture_facts(req, r, hosts, units)
            if hosts.listening(units[0], w.launch.port):
                raise CaptureError("port %d is in use on host %s (unit %s): stop that workload (sparkrun stop) or capture on another port" % (w.launch.port, units[0].host, units[0].name))
            store.init()
        with rb.phase("model_digests"):
            recorded_files = model_files.record(model_dir)
        with store.staging_dir("capture-") as staging, _io_uring_off(hosts, units):
            progress.step("starting %d units of %s for capture on %s" % (len(units), req.capsule.ref, ", ".join(u.host for u in units)))
            validation, _ = start_units(r, req, hosts, rb, progress, init_port=init_port, launch=lambda u: launches[u.name])
            progress.note("first token %.1f s after launch; reply %r" % (validation.ttft_seconds or 0, validation.reply))
            rb.details["vanilla_ttft_seconds"] = validation.ttft_seconds
            native, native_files = _release(r, req, hosts, units, rb, progress, native_wanted=native_wanted)
            images, files, scratch = _checkpoint(r, hosts, units, by_name, rb, progress, attempt.on_failure)
            layers = _gather(req, hosts, units, scratch, staging, rb, progress, zero_pages=settings.zero_pages)
            _remove(hosts, units, scratch)  # gathered: the hosts' copies are not needed any more
            with rb.phase("model_check"):
                changed = model_files.verify(model_dir, recorded_files)
            if changed:
                raise CaptureError("the model files changed while the engines loaded them: %s; capture again" % "; ".join(changed))
            unit_images = tuple(
                images[u.name].model_copy(update={
                    "files": files[u.name], "image_bytes": layers[u.name][1],
                    "driver_data": images[u.name].driver_data.merged(DriverData(native_files=tuple(native_files[u.name])) if native is not None else DriverData()),
                })
                for u in units
            )  # fmt: skip
            config = capsule_config(req, r, fingerprint, validation, recorded_files, native, unit_images)
            packed = [layer for u in units for layer in layers[u.name][0]]
            with rb.phase("publish"):
                desc = capsule_mod.publish(store, packed, config)
            rb.details["image_bytes"] = sum(i.image_bytes for i in unit_images)
            rb.details["capsule_bytes"] = sum(layer.size for layer in packed)
    rb.capsule = desc.digest
    return CaptureOutcome(finish(rb, None), capsule_mod.open_capsule(store, req.capsule.ref))


def capture_launches(r: Resolved, w: Workload, units: Sequence[LaunchUnit], rb: ReceiptBuilder, *, native_wanted: bool) -> dict[str, tuple[str, dict[str, str]]]:
    """Each unit's command and environment for capture: the recipe's, with what the engine
    needs to release its memory and write its native payload, and what the driver needs to
    checkpoint it (n610, several ranks: collectives that share no device memory, over sockets
    on the interfaces placement chose). What the driver added goes in the receipt."""
    out = {}
    for u in units:
        launched = r.adapter.prepare_launch(*recipe_launch(w)(u), release_weights=r.driver.needs_release, native_weights=native_wanted)
        command, env = r.driver.launch_settings(*launched, adapter=r.adapter, topology=w.topology)
        if (command, env) != launched and "driver_launch" not in rb.details:  # the same for every unit
            rb.details["driver_launch"] = {"flags": command[len(launched[0]) :].split(), "env": {k: v for k, v in env.items() if launched[1].get(k) != v}}
        out[u.name] = command, env
    return out


def _capture_facts(req: CaptureRequest, r: Resolved, hosts: UnitHosts, units: list[LaunchUnit]) -> Fingerprint:
    """Every host can capture with the driver and sees the workload as rank 0's host does; rank
    0's fingerprint, the one the capsule records (every host's admission compares its own)."""
    step = CaptureFactsStep(request=req)
    answers = on_every_unit(units, lambda u: hosts.call(u, step, timeout=300))
    refused = ["host %s (unit %s): %s" % (u.host, u.name, answers[u.name].reason) for u in units if not answers[u.name].supported]
    if refused:
        raise CaptureError("snapshot driver %s cannot capture on %s" % (r.driver.name, "; ".join(refused)))
    head = answers[units[0].name].fingerprint
    differ = []
    for u in units[1:]:
        mismatches = compare(head, answers[u.name].fingerprint)
        if mismatches:
            differ.append("host %s (unit %s): %s" % (u.host, u.name, "; ".join(str(m) for m in mismatches)))
    if differ:
        raise CaptureError("the hosts differ from rank 0's host %s, where a restore would be refused: %s; capture on alike hosts" % (units[0].host, " | ".join(differ)))
    return head


def _release(
    r: Resolved, req: CaptureRequest, hosts: UnitHosts, units: list[LaunchUnit], rb: ReceiptBuilder, progress: Progress, *, native_wanted: bool,
) -> tuple[NativePayload | None, dict[str, list[str]]]:  # fmt: skip
    """Where the weights leave the capsule: every rank's native payload written on its host, then
    the engine's device memory released, both through rank 0 (vLLM's sleep reaches every rank)."""
    endpoint = rank0_endpoint(r, req.workload, hosts)
    native, parts = units_weights.export_native(r, req, hosts, units, endpoint, rb, progress) if native_wanted else (None, {})
    if r.driver.needs_release:
        with rb.phase("release_memory"), progress.waiting("releasing the engine's device memory through rank 0"):
            r.adapter.release_memory(endpoint)
    return native, parts


def _checkpoint(
    r: Resolved, hosts: UnitHosts, units: list[LaunchUnit], by_name: dict[str, LaunchUnit], rb: ReceiptBuilder, progress: Progress,
    on_failure: Callable[[Callable[[], object]], None],
) -> tuple[dict[str, UnitImage], dict[str, tuple[RecordedFile, ...]], dict[str, str]]:  # fmt: skip
    """Record every unit's files, checkpoint all at one cut, stop them there; (images, files,
    each host's scratch directory, removed when the operation ends)."""
    roots = {u.name: hosts.root_pid(u) for u in units}
    with rb.phase("record_files"):
        answers = on_every_unit(units, lambda u: hosts.call(u, FilesStep(root_pid=roots[u.name], name=hosts.rank_name(u))))
    files = {name: a.files for name, a in answers.items()}
    scratch = {u.name: hosts.call(u, InboxStep()).path for u in units}
    on_failure(lambda: _remove(hosts, units, scratch))
    targets = [UnitOnHost(u.name, u.host, roots[u.name], scratch[u.name] + "/images") for u in units]
    devices = AgentDevices(hosts, by_name, r.driver.name) if r.driver.device_state else None
    with rb.phase("checkpoint"), progress.waiting("checkpointing %d units at one cut" % len(units)):
        cut = checkpoint_units(AgentCut(hosts, by_name, r.driver.name), targets, resume=False, devices=devices)
    # Still stopped at the cut: the engines end here, before any of them sends again.
    hosts.stop_all()
    rb.details["units"] = {name: {"phases": {k: round(v, 4) for k, v in p.items()}, "host": by_name[name].host} for name, p in cut.phases.items()}
    rb.details["barriers"] = {k: round(v, 4) for k, v in cut.barriers.items()}
    # What the driver needs of each unit's devices at restore, beside what its dump recorded.
    images = {name: image.model_copy(update={"driver_data": image.driver_data.merged(cut.devices.get(name, DriverData()))}) for name, image in cut.dumped.items()}
    return images, files, scratch


def _remove(hosts: UnitHosts, units: Sequence[LaunchUnit], dirs: dict[str, str]) -> None:
    for u in units:
        if dirs.get(u.name):
            with contextlib.suppress(ColdsnapError):
                hosts.call(u, RemoveStep(paths=(dirs[u.name],)), timeout=300)


def _gather(
    req: CaptureRequest, hosts: UnitHosts, units: list[LaunchUnit], scratch: dict[str, str], staging: Path, rb: ReceiptBuilder, progress: Progress,
    *, zero_pages: bool,
) -> dict[str, tuple[list[PackedLayer], int]]:  # fmt: skip
    """Each host packs its unit's layers; they are copied into *staging* with their digests checked."""
    with rb.phase("pack"), progress.waiting("packing each unit's layers on its host"):
        packed = on_every_unit(units, lambda u: hosts.call(u, PackStep(
            images=scratch[u.name] + "/images", unit=u.name, out=scratch[u.name] + "/layers", driver=req.workload.driver, zero_pages=zero_pages,
        ), timeout=1800))  # fmt: skip
    out: dict[str, tuple[list[PackedLayer], int]] = {}
    total = sum(layer.size for a in packed.values() for layer in a.layers)
    with rb.phase("gather"), progress.transfer("gathering %.1f MB of layers from %d hosts" % (total / 1e6, len(units)), total) as tick:
        for u in units:
            mine = []
            for layer in packed[u.name].layers:
                local = staging / Path(layer.path).name
                hosts.fetch(u, layer.path, local, digest=layer.digest, size=layer.size, tick=tick)
                mine.append(PackedLayer(path=local, digest=layer.digest, size=layer.size, media_type=layer.media_type, annotations=dict(layer.annotations)))
            out[u.name] = (mine, packed[u.name].image_bytes)
    rb.details["zero_pages"] = {name: a.zero_pages for name, a in packed.items()}
    return out
