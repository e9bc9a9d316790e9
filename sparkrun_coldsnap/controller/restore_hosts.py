"""The restore's steps for a capsule of several units, each on its own host
(``restore.RestoreUnits``), each reaching its unit through the typed steps of ``units/``.

The capsule's topology must be the run's (host count, each rank on the host it was captured
on: the ranks' connections come back as they were, to the captured addresses); every unit is
admitted on its own host with that host's fingerprint, and the one weight path every host can
take is chosen; each host receives and unpacks its unit's layers; all before anything is
stopped. Then the workload being replaced is stopped, every unit is restored on its host at
once, still stopped at the cut, recorded as its rank (sparkrun's ``status``/``stop`` see it)
and continued (``cut.restore_units``: then every unit's devices given back, then unlocked),
and the weights are brought back through rank 0. A failure stops every unit on its host.
"""

from __future__ import annotations

from pathlib import Path

from sparkrun_coldsnap.capsule import capsule_crypto, media
from sparkrun_coldsnap.capsule.capsule import Capsule
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.controller import units_weights
from sparkrun_coldsnap.controller.admit import resolve_across_hosts
from sparkrun_coldsnap.controller.common import Attempt
from sparkrun_coldsnap.controller.cut import CoordinatedRestore, on_every_unit, restore_units
from sparkrun_coldsnap.controller.ranks import ordered, rank0_endpoint
from sparkrun_coldsnap.controller.restore import PreparedRestore, Preparing
from sparkrun_coldsnap.controller.units_agent import AgentRestore
from sparkrun_coldsnap.documents.request import LaunchUnit, RestoreRequest
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import ColdsnapError, CompatibilityError, RestoreError
from sparkrun_coldsnap.launch.base import RunningUnit
from sparkrun_coldsnap.launch.remote import UnitHosts
from sparkrun_coldsnap.progress import Progress
from sparkrun_coldsnap.units.resolved import Resolved
from sparkrun_coldsnap.units.steps import AdmitStep, InboxStep, LayerRef, RemoveStep, StageStep
from sparkrun_coldsnap.weights.weight_paths import WeightChoice


class HostsRestore:
    """Every launch unit of the capsule on its host, reached through *hosts*."""

    told = "every unit restored has been stopped"
    replied = "restored rank 0"
    where = "these hosts"

    def __init__(self, hosts: UnitHosts) -> None:
        self.hosts = hosts
        self.units: list[LaunchUnit] = []
        #: each unit's staging directory and images on its host, by unit
        self.staged: dict[str, dict[str, str]] = {}
        #: each unit's restored root, filled as each one's restore returns
        self.roots: dict[str, int] = {}
        self.steps: AgentRestore | None = None
        self.done: CoordinatedRestore | None = None
        #: what the units' logs said of errors when a failure stopped them
        self.log_errors: list[str] = []

    def resolve(self, p: Preparing) -> Resolved:
        self.units = ordered(p.req.workload)
        r = resolve_across_hosts(p.req.workload, p.settings)
        refuse_topology(p.capsule, p.req)
        return r

    def admit(self, p: Preparing) -> tuple[WeightChoice | None, tuple[str, ...]]:
        """Every unit admitted on its host (its GPUs, its PIDs, its files, its part of the
        weights); the one weight path every host can take."""
        cap, req, hosts, units = p.capsule, p.req, self.hosts, self.units
        if capsule_crypto.encrypted_layers(cap):
            # Each host unpacks its own layers and no private key is sent to it.
            raise CompatibilityError("admission refused for capsule %s: its layers are encrypted, which a restore across hosts does not decrypt: restore it on one host" % req.capsule.ref)
        hosts.check_reachable(units)
        answers = on_every_unit(units, lambda u: hosts.call(u, AdmitStep(config=cap.config, request=req, unit=u.name, pattern=hosts.rank_pattern(u)), timeout=300))
        refused = ["unit %s on host %s: %s" % (u.name, u.host, "; ".join(answers[u.name].problems)) for u in units if answers[u.name].problems]
        if refused:
            raise CompatibilityError("admission refused for capsule %s: %s" % (req.capsule.ref, " | ".join(refused)))
        weights = units_weights.choose(req, units, answers)
        if weights is not None and weights.note:
            p.rb.details["weights_note"] = weights.note
        return weights, ()

    def stage(self, p: Preparing, weights: WeightChoice | None) -> WeightChoice | None:
        p.attempt.on_failure(self.discard)
        with p.rb.phase("prepare.stage"), p.progress.waiting("sending and unpacking each unit's layers on its host"):
            self.staged = on_every_unit(self.units, lambda u: self._stage(p.store, p.capsule, u))
        return weights

    def _stage(self, store: CapsuleStore, cap: Capsule, u: LaunchUnit) -> dict[str, str]:
        layers = [d for d in cap.layers if (d.annotations or {}).get(media.A_UNIT) == u.name]
        if not layers:
            raise RestoreError("capsule %s holds no layers of unit %s: recapture" % (cap.ref or cap.digest, u.name))
        inbox = self.hosts.call(u, InboxStep(), timeout=60)
        self.hosts.send(u, [store.blob_path(d.digest) for d in layers], inbox.blobs)
        unpacked = sum(int((d.annotations or {}).get(media.A_UNPACKED_SIZE, d.size)) for d in layers)
        refs = tuple(LayerRef(media_type=d.media_type, digest=d.digest, size=d.size, annotations=d.annotations or {}) for d in layers)
        answer = self.hosts.call(u, StageStep(inbox=inbox.path, layers=refs, unit=u.name, unpacked_bytes=unpacked), timeout=1800)
        return {"staging": answer.staging, "images": answer.images}

    def discard(self) -> None:
        """Remove what preparation staged on every host."""
        for u in self.units:
            where = self.staged.pop(u.name, None)
            if where:
                try:
                    self.hosts.call(u, RemoveStep(paths=(where["staging"],)), timeout=300)
                except ColdsnapError:
                    pass  # the host's next operation (or gc) frees it

    def evict(self, prepared: PreparedRestore, attempt: Attempt) -> None:
        attempt.stops(self._stop_restored, told=self._told)
        with prepared.receipt.phase("evict"):
            replaced = self.hosts.stop_named(self.units)
        if replaced:
            prepared.receipt.details["replaced_units"] = replaced

    def restore(self, prepared: PreparedRestore, attempt: Attempt, *, log_path: Path | None, progress: Progress) -> RunningUnit:
        cap, r = prepared.capsule, prepared.resolved
        self.steps = AgentRestore(self.hosts, {i.name: i for i in cap.config.units}, {n: s["images"] for n, s in self.staged.items()}, r.driver.name)
        with progress.waiting("restoring %d units, each on its host" % len(self.units)):
            self.done = restore_units(self.steps, self.units, self.roots, devices=r.driver.device_state)
        return SparkrunRanks(self.units[0].host, self.roots[self.units[0].name])

    def _told(self) -> str:
        return self.told + ("; the ranks' logs: %s" % " | ".join(self.log_errors) if self.log_errors else "")

    def endpoint(self, prepared: PreparedRestore) -> Endpoint:
        return rank0_endpoint(prepared.resolved, prepared.request.workload, self.hosts)

    def weights_back(self, prepared: PreparedRestore, running: RunningUnit, endpoint: Endpoint, progress: Progress) -> None:
        r, req, rb = prepared.resolved, prepared.request, prepared.receipt
        if prepared.weights is not None:
            units_weights.hydrate(r, req, prepared.capsule.config, prepared.weights, endpoint, rb, progress)
        with rb.phase("ready"):
            r.adapter.wait_ready(endpoint, alive=self.hosts.alive, timeout=req.ready_timeout_seconds)

    def after_validation(self, prepared: PreparedRestore, endpoint: Endpoint) -> None:
        pass  # the weights were read from the hosts' own files: nothing is held for them here

    def record(self, prepared: PreparedRestore, running: RunningUnit) -> None:
        rb, done, steps = prepared.receipt, self.done, self.steps
        assert done is not None and steps is not None
        rb.details["units"] = {
            u.name: {"host": u.host, "root_pid": self.roots[u.name], "restore_seconds": round(done.phases[u.name]["restore"], 4), "phases": {k: round(v, 4) for k, v in done.phases[u.name].items()}}
            for u in self.units
        }  # fmt: skip
        for u in self.units:
            # Each host's count of its unit's processes given back their AMX tile permission.
            measured = steps.details.get(u.name)
            if measured is not None and measured.amx_permission is not None:
                rb.details["units"][u.name]["amx_permission"] = measured.amx_permission.model_dump(mode="json")
        rb.details["barriers"] = {k: round(v, 4) for k, v in done.barriers.items()}

    def _stop_restored(self) -> list[str]:
        """Restored trees not yet adopted as ranks ended by their process group, then every unit
        this operation started or adopted stopped; the problems, one per unit. What the units'
        logs say of errors is read first: a rank that failed after its restore (a CUDA error in a
        worker) leaves the head answering only that the engine failed."""
        self.log_errors = self.hosts.log_errors()
        for u in self.units:
            if u.name in self.roots:
                try:
                    self.hosts.signal_group(u, self.roots[u.name], "KILL")
                except ColdsnapError:
                    pass
        return self.hosts.stop_all()


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


class SparkrunRanks:
    """The unit a restore of several units hands back: the ranks it restored, each recorded on
    its host as sparkrun's (``sparkrun status`` sees them, ``sparkrun stop`` stops them). This
    process holds no tree of its own, so stopping or reaping here does nothing; *host* is rank
    0's and *root_pid* its restored root there."""

    def __init__(self, host: str, root_pid: int) -> None:
        self.host = host
        self._root_pid = root_pid

    @property
    def root_pid(self) -> int:
        return self._root_pid

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
