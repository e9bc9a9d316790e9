"""Restore of a capsule of several units, each on its own host (``controller/units.py`` tells
the whole story): prepare (topology, per-host admission with the weight path each host can
take, per-host staging, all while the workload it replaces still serves), then activate (stop
that one, restore every unit at once, record them as the ranks, continue them, give every
unit its devices back and unlock them, bring the weights back and validate through rank 0)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule import media
from sparkrun_coldsnap.capsule.capsule import Capsule
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.controller import units_weights
from sparkrun_coldsnap.controller.admit import resolve_across_hosts
from sparkrun_coldsnap.controller.common import Attempt, ServingOutcome, finish, validate
from sparkrun_coldsnap.controller.cut import on_every_unit, restore_units
from sparkrun_coldsnap.controller.units import ordered, rank0_endpoint
from sparkrun_coldsnap.controller.units_agent import AgentRestore
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder, Weights
from sparkrun_coldsnap.documents.request import LaunchUnit, RestoreRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.errors import ColdsnapError, CompatibilityError, RestoreError, ValidationError
from sparkrun_coldsnap.launch.remote import UnitHosts
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.units.resolved import Resolved
from sparkrun_coldsnap.units.steps import AdmitStep, InboxStep, LayerRef, RemoveStep, StageStep
from sparkrun_coldsnap.weights.weight_paths import WeightChoice


@dataclass
class PreparedUnits:
    """A capsule of several units admitted on every host and staged there (nothing stopped yet)."""

    request: RestoreRequest
    capsule: Capsule
    resolved: Resolved
    settings: Settings
    receipt: ReceiptBuilder
    hosts: UnitHosts
    staged: dict[str, dict[str, str]] = field(default_factory=dict)
    prepare_seconds: float = 0.0
    #: how the weights come back, when they are not in the images (decided on every host)
    weights: WeightChoice | None = None

    def discard(self) -> None:
        """Remove what preparation staged on every host."""
        for u in ordered(self.request.workload):
            where = self.staged.pop(u.name, None)
            if where:
                try:
                    self.hosts.call(u, RemoveStep(paths=(where["staging"],)), timeout=300)
                except ColdsnapError:
                    pass  # the host's next operation (or gc) frees it


def topology_problems(cap: Capsule, req: RestoreRequest) -> list[str]:
    """How the run's placement differs from the capsule's: its units must be the captured
    ranks on the captured hosts, since their connections come back to the captured addresses."""
    captured = {u.name: u for u in cap.config.workload.topology.units}
    placed = {u.name: u for u in req.workload.topology.units}
    hosts = lambda units: ", ".join("%s on %s" % (u.name, u.host) for u in sorted(units.values(), key=lambda u: u.rank))  # noqa: E731
    if set(captured) != set(placed):
        return ["the capsule has %d units (%s), the run places %d (%s)" % (len(captured), hosts(captured), len(placed), hosts(placed))]
    return ["unit %s ran on host %s at capture, the run places it on host %s" % (name, captured[name].host, placed[name].host) for name in sorted(captured) if captured[name].host != placed[name].host]


def refuse_topology(cap: Capsule, req: RestoreRequest) -> None:
    problems = topology_problems(cap, req)
    if problems:
        order = ",".join(u.host for u in ordered(cap.config.workload))
        raise CompatibilityError(
            "capsule %s does not fit this placement: %s; the ranks reach each other at the captured addresses: run on the captured hosts in rank order (-H %s) or capture again on these" % (req.capsule.ref, "; ".join(problems), order),
            code="compatibility.topology",
        )


def prepare_units(req: RestoreRequest, hosts: UnitHosts, *, store: CapsuleStore, settings: Settings | None = None, progress: Progress = QUIET) -> PreparedUnits:
    """Topology, admission on every host, each unit's layers staged on its host."""
    settings = settings or settings_mod.current()
    rb = ReceiptBuilder("restore", request_sha256=req.digest())
    rb.capsule_ref, rb.secrets = req.capsule.ref, req.workload.secret_values()
    t = time.monotonic()
    units = ordered(req.workload)
    with settings_mod.using(settings):
        with rb.phase("prepare.open"):
            store.check_trusted()
            cap = capsule_mod.open_capsule(store, req.capsule.ref)
            rb.capsule = cap.digest
        prepared = PreparedUnits(req, cap, resolve_across_hosts(req.workload, settings), settings, rb, hosts)
        with Attempt(rb) as attempt:
            attempt.on_failure(prepared.discard)
            with rb.phase("prepare.admission"):
                refuse_topology(cap, req)
                if cap.config.driver != prepared.resolved.driver.name:
                    raise CompatibilityError("capsule %s was captured with driver %s, the recipe asks for %s" % (req.capsule.ref, cap.config.driver, prepared.resolved.driver.name))
                hosts.check_reachable(units)
                prepared.weights = _admit_everywhere(cap, req, hosts, units)
                if prepared.weights is not None and prepared.weights.note:
                    rb.details["weights_note"] = prepared.weights.note
            with rb.phase("prepare.stage"), progress.waiting("sending and unpacking each unit's layers on its host"):
                prepared.staged = on_every_unit(units, lambda u: _stage(store, cap, hosts, u))
    prepared.prepare_seconds = time.monotonic() - t
    return prepared


def _admit_everywhere(cap: Capsule, req: RestoreRequest, hosts: UnitHosts, units: list[LaunchUnit]) -> WeightChoice | None:
    """Every unit admitted on its host (its GPUs, its PIDs, its files, its part of the weights);
    the one weight path every host can take."""
    answers = on_every_unit(units, lambda u: hosts.call(u, AdmitStep(config=cap.config, request=req, unit=u.name, pattern=hosts.rank_pattern(u)), timeout=300))
    refused = ["unit %s on host %s: %s" % (u.name, u.host, "; ".join(answers[u.name].problems)) for u in units if answers[u.name].problems]
    if refused:
        raise CompatibilityError("admission refused for capsule %s: %s" % (req.capsule.ref, " | ".join(refused)))
    return units_weights.choose(req, units, answers)


def _stage(store: CapsuleStore, cap: Capsule, hosts: UnitHosts, u: LaunchUnit) -> dict[str, str]:
    layers = [d for d in cap.layers if (d.annotations or {}).get(media.A_UNIT) == u.name]
    if not layers:
        raise RestoreError("capsule %s holds no layers of unit %s: recapture" % (cap.ref or cap.digest, u.name))
    inbox = hosts.call(u, InboxStep(), timeout=60)
    hosts.send(u, [store.blob_path(d.digest) for d in layers], inbox.blobs)
    unpacked = sum(int((d.annotations or {}).get(media.A_UNPACKED_SIZE, d.size)) for d in layers)
    refs = tuple(LayerRef(media_type=d.media_type, digest=d.digest, size=d.size, annotations=d.annotations or {}) for d in layers)
    answer = hosts.call(u, StageStep(inbox=inbox.path, layers=refs, unit=u.name, unpacked_bytes=unpacked), timeout=1800)
    return {"staging": answer.staging, "images": answer.images}


def activate_units(prepared: PreparedUnits, *, progress: Progress = QUIET) -> ServingOutcome:
    """Stop the workload being replaced, restore every unit at once (devices last), bring the
    weights back and validate through rank 0."""
    rb, req, cap, r, hosts = prepared.receipt, prepared.request, prepared.capsule, prepared.resolved, prepared.hosts
    units = ordered(req.workload)
    roots: dict[str, int] = {}
    try:
        with settings_mod.using(prepared.settings):
            with Attempt(rb, stop=lambda: _stop_restored(hosts, units, roots), told="every unit restored has been stopped"):
                with rb.phase("evict"):
                    replaced = hosts.stop_named(units)
                if replaced:
                    rb.details["replaced_units"] = replaced
                t0 = time.monotonic()
                steps = AgentRestore(hosts, {i.name: i for i in cap.config.units}, {n: s["images"] for n, s in prepared.staged.items()}, r.driver.name)
                with rb.phase("restore"), progress.waiting("restoring %d units, each on its host" % len(units)):
                    done = restore_units(steps, units, roots, devices=r.driver.device_state)
                endpoint = rank0_endpoint(r, req.workload, hosts)
                if prepared.weights is not None:
                    units_weights.hydrate(r, req, cap.config, prepared.weights, endpoint, rb, progress)
                with rb.phase("ready"):
                    r.adapter.wait_ready(endpoint, alive=hosts.alive, timeout=req.ready_timeout_seconds)
                expected = req.validation.expected_reply or cap.config.validation.reply
                with rb.phase("validate"):
                    validation = validate(r, endpoint, req, t0, expected)
                rb.validation = validation
                if not validation.passed:
                    raise ValidationError("restored rank 0 replied %r, capsule %s recorded %r: the capsule does not match these hosts; recapture" % (validation.reply, req.capsule.ref, expected))
                if prepared.weights is None:
                    rb.weights = Weights(path="in-image")
            rb.details["prepare_seconds"] = round(prepared.prepare_seconds, 4)
            rb.details["units"] = {
                u.name: {"host": u.host, "root_pid": roots[u.name], "restore_seconds": round(done.phases[u.name]["restore"], 4), "phases": {k: round(v, 4) for k, v in done.phases[u.name].items()}}
                for u in units
            }  # fmt: skip
            for u in units:
                # Each host's count of its unit's processes given back their AMX tile permission.
                tiles = steps.details.get(u.name, {}).get("amx_permission")
                if tiles is not None:
                    rb.details["units"][u.name]["amx_permission"] = tiles
            rb.details["barriers"] = {k: round(v, 4) for k, v in done.barriers.items()}
            return ServingOutcome(finish(rb, None), roots[units[0].name], validation.ttft_seconds, SparkrunRanks(units[0].host))
    finally:
        prepared.discard()


def _stop_restored(hosts: UnitHosts, units: list[LaunchUnit], roots: dict[str, int]) -> list[str]:
    """Restored trees not yet adopted as ranks ended by their process group, then every unit
    this operation started or adopted stopped; the problems, one per unit."""
    for u in units:
        if u.name in roots:
            try:
                hosts.signal_group(u, roots[u.name], "KILL")
            except ColdsnapError:
                pass
    return hosts.stop_all()


class SparkrunRanks:
    """The unit a restore of several units hands back: the ranks it restored, each recorded on
    its host as sparkrun's (``sparkrun status`` sees them, ``sparkrun stop`` stops them). This
    process holds no tree of its own, so stopping or reaping here does nothing; *host* is rank 0's."""

    def __init__(self, host: str) -> None:
        self.host = host

    @property
    def root_pid(self) -> int:
        return 0

    def alive(self) -> bool:
        return True

    def stop(self, grace: float = 10.0) -> None:
        pass

    def tail(self) -> str:
        return ""

    def reap(self, timeout: float = 10.0) -> None:
        pass

    def log_location(self) -> str:
        return "sparkrun logs (every rank on its host)"
