"""The capture's steps for a workload placed as several launch units, one per host
(``capture.CaptureUnits``), each reaching its unit through the typed steps of ``units/``.

Every host answers, and its driver can capture there, before anything starts; the ranks are
started on their hosts (head first, workers once the head listens on the rendezvous port)
with what the driver needs of their launch, and validated through rank 0; where the weights
leave the capsule (GPU drivers) every rank writes its native payload on its host and the
engine releases its memory, both asked of rank 0; every unit's files are recorded on its
host; the units are checkpointed at one consistent cut (``cut.checkpoint_units``: every
unit's devices locked, then checkpointed, then every unit stopped and dumped) and end there;
each host leaves its zero pages out and packs its own unit's layers, which are gathered
(digests checked) into the one store, and the capsule is published only when every unit's
layers are in. A failure stops what the capture started on every host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path

from sparkrun_coldsnap import secrets
from sparkrun_coldsnap.capsule.pack import PackedLayer
from sparkrun_coldsnap.compat.fingerprint import compare
from sparkrun_coldsnap.controller import socket_ifnames, units_weights
from sparkrun_coldsnap.controller.admit import resolve_across_hosts
from sparkrun_coldsnap.controller.capture import Capturing
from sparkrun_coldsnap.controller.cut import UnitOnHost, checkpoint_units, on_every_unit
from sparkrun_coldsnap.controller.ranks import io_uring_off, ordered, rank0_endpoint, ready_ranks, recipe_launch, start_ranks
from sparkrun_coldsnap.controller.units_agent import AgentCut, AgentDevices
from sparkrun_coldsnap.documents.capsule_config import NativePayload
from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.documents.fingerprint import Fingerprint
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder, Validation
from sparkrun_coldsnap.documents.request import LaunchUnit, Workload
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import CaptureError, ColdsnapError
from sparkrun_coldsnap.host import netfilter
from sparkrun_coldsnap.launch.remote import UnitHosts
from sparkrun_coldsnap.units.resolved import Resolved
from sparkrun_coldsnap.units.steps import CaptureFactsStep, FilesStep, InboxStep, PackStep, RemoveStep


class HostsCapture:
    """Every launch unit of the workload on its host, reached through *hosts*."""

    operation = "capture"
    live = False

    def __init__(self, hosts: UnitHosts, *, init_port: int) -> None:
        self.hosts = hosts
        self.init_port = init_port
        self.units: list[LaunchUnit] = []
        self.launches: dict[str, tuple[str, dict[str, str]]] = {}
        self.head_fingerprint: Fingerprint | None = None
        #: each unit's native payload files on its host, by unit
        self.native_files: dict[str, list[str]] = {}
        #: each host's scratch directory, removed when the capture ends
        self.scratch: dict[str, str] = {}

    def resolve(self, c: Capturing) -> Resolved:
        self.units = ordered(c.req.workload)
        # Any failure stops every unit this capture started, on every host.
        c.attempt.stops(self.hosts.stop_all, told="every unit started has been stopped and nothing was published")
        return resolve_across_hosts(c.req.workload, c.settings)

    def admit(self, c: Capturing) -> None:
        w, units = c.req.workload, self.units
        self.launches = capture_launches(c.r, w, units, c.rb, native_wanted=c.native_wanted, on_launch=c.launched_with)  # a refused setting stops it here, before anything starts
        self.hosts.check_reachable(units)
        self.head_fingerprint = self._capture_facts(c)
        # Bound here, in admission: a host where the collectives' interface cannot be found is
        # refused before io_uring is switched off or any engine starts.
        self.launches = socket_ifnames.pinned(units, self.hosts, self.launches, c.rb)
        if self.hosts.listening(units[0], w.launch.port):
            raise CaptureError("port %d is in use on host %s (unit %s): stop that workload (sparkrun stop) or capture on another port" % (w.launch.port, units[0].host, units[0].name))

    def _capture_facts(self, c: Capturing) -> Fingerprint:
        """Every host can capture with the driver and sees the workload as rank 0's host does; rank
        0's fingerprint, the one the capsule records (every host's admission compares its own)."""
        units, hosts = self.units, self.hosts
        step = CaptureFactsStep(request=c.req)
        answers = on_every_unit(units, lambda u: hosts.call(u, step, timeout=300))
        refused = ["host %s (unit %s): %s" % (u.host, u.name, answers[u.name].reason) for u in units if not answers[u.name].supported]
        if refused:
            raise CaptureError("snapshot driver %s cannot capture on %s" % (c.r.driver.name, "; ".join(refused)))
        lacking = ["host %s (unit %s) lacks %s" % (u.host, u.name, ", ".join(answers[u.name].missing_tools)) for u in units if answers[u.name].missing_tools]
        if lacking:
            raise CaptureError("%s, which a capture across hosts runs (CRIU's network lock holds each connection to another host with it): run `%s` on every host" % ("; ".join(lacking), netfilter.FIX))
        head = answers[units[0].name].fingerprint
        differ = []
        for u in units[1:]:
            mismatches = compare(head, answers[u.name].fingerprint)
            if mismatches:
                differ.append("host %s (unit %s): %s" % (u.host, u.name, "; ".join(str(m) for m in mismatches)))
        if differ:
            raise CaptureError("the hosts differ from rank 0's host %s, where a restore would be refused: %s; capture on alike hosts" % (units[0].host, " | ".join(differ)))
        return head

    def start(self, c: Capturing, staging: Path, stack: contextlib.ExitStack) -> float:
        stack.enter_context(io_uring_off(self.hosts, self.units))
        c.progress.step("starting %d units of %s for capture on %s" % (len(self.units), c.req.capsule.ref, ", ".join(u.host for u in self.units)))
        return start_ranks(c.req.workload, self.hosts, c.rb, c.progress, init_port=self.init_port, launch=lambda u: self.launches[u.name])

    def endpoint(self, c: Capturing) -> Endpoint:
        return rank0_endpoint(c.r, c.req.workload, self.hosts)

    def ready(self, c: Capturing, t0: float) -> Validation:
        return ready_ranks(c.r, c.req, self.hosts, c.rb, c.progress, t0)

    def write_native(self, c: Capturing) -> NativePayload | None:
        """Every rank's part of the payload written on its host, through rank 0 (vLLM's calls reach every rank)."""
        native, self.native_files = units_weights.export_native(c.r, c.req, self.hosts, self.units, self.endpoint(c), c.rb, c.progress)
        return native

    def await_boundary(self, c: Capturing) -> None:
        raise CaptureError("driver %s has no boundary to wait for across hosts: set coldsnap.driver to one that captures serving engines" % c.r.driver.name)

    def checkpoint(self, c: Capturing, staging: Path) -> list[UnitImage]:
        """Every unit's files recorded, all checkpointed at one cut; they end there."""
        r, rb, hosts, units = c.r, c.rb, self.hosts, self.units
        by_name = {u.name: u for u in units}
        roots = {u.name: hosts.root_pid(u) for u in units}
        with rb.phase("record_files"):
            answers = on_every_unit(units, lambda u: hosts.call(u, FilesStep(root_pid=roots[u.name], name=hosts.rank_name(u))))
        self.scratch = {u.name: hosts.call(u, InboxStep()).path for u in units}
        c.attempt.on_failure(self._remove_scratch)
        targets = [UnitOnHost(u.name, u.host, roots[u.name], self.scratch[u.name] + "/images") for u in units]
        devices = AgentDevices(hosts, by_name, r.driver.name) if r.driver.device_state else None
        with rb.phase("checkpoint"), c.progress.waiting("checkpointing %d units at one cut" % len(units)):
            cut = checkpoint_units(AgentCut(hosts, by_name, r.driver.name), targets, resume=False, devices=devices)
        # Still stopped at the cut: the engines end here, before any of them sends again.
        hosts.stop_all()
        rb.details["units"] = {name: {"phases": {k: round(v, 4) for k, v in p.items()}, "host": by_name[name].host} for name, p in cut.phases.items()}
        rb.details["barriers"] = {k: round(v, 4) for k, v in cut.barriers.items()}
        # What the driver needs of each unit's devices at restore, beside what its dump recorded.
        return [
            cut.dumped[u.name].model_copy(update={"files": answers[u.name].files, "driver_data": cut.dumped[u.name].driver_data.merged(cut.devices.get(u.name, DriverData()))})
            for u in units
        ]  # fmt: skip

    def after_checkpoint(self, c: Capturing) -> None:
        pass  # the units ended at the cut

    def end(self, c: Capturing, images: list[UnitImage]) -> None:
        pass  # stopped at the cut, before any of them sent again

    def failed(self, c: Capturing, err: ColdsnapError) -> None:
        pass  # the attempt stops every unit on its host

    def pack(self, c: Capturing, staging: Path, images: list[UnitImage], native: NativePayload | None) -> tuple[list[PackedLayer], list[UnitImage]]:
        """Each host packs its unit's layers; they are copied into *staging* with their digests checked."""
        rb, hosts, units, scratch = c.rb, self.hosts, self.units, self.scratch
        with rb.phase("pack"), c.progress.waiting("packing each unit's layers on its host"):
            packed = on_every_unit(units, lambda u: hosts.call(u, PackStep(
                images=scratch[u.name] + "/images", unit=u.name, out=scratch[u.name] + "/layers", driver=c.req.workload.driver, zero_pages=c.settings.zero_pages,
            ), timeout=1800))  # fmt: skip
        layers: list[PackedLayer] = []
        total = sum(layer.size for a in packed.values() for layer in a.layers)
        with rb.phase("gather"), c.progress.transfer("gathering %.1f MB of layers from %d hosts" % (total / 1e6, len(units)), total) as tick:
            for u in units:
                for layer in packed[u.name].layers:
                    local = staging / Path(layer.path).name
                    hosts.fetch(u, layer.path, local, digest=layer.digest, size=layer.size, tick=tick)
                    layers.append(PackedLayer(path=local, digest=layer.digest, size=layer.size, media_type=layer.media_type, annotations=dict(layer.annotations)))
        rb.details["zero_pages"] = {name: a.zero_pages for name, a in packed.items()}
        self._remove_scratch()  # gathered: the hosts' copies are not needed any more
        return layers, [
            image.model_copy(update={
                "image_bytes": packed[u.name].image_bytes,
                "driver_data": image.driver_data.merged(DriverData(native_files=tuple(self.native_files[u.name])) if native is not None else DriverData()),
            })
            for u, image in zip(units, images, strict=True)
        ]  # fmt: skip

    def fingerprint(self, c: Capturing, images: list[UnitImage]) -> Fingerprint:
        assert self.head_fingerprint is not None, "admission records rank 0's fingerprint"
        return self.head_fingerprint

    def _remove_scratch(self) -> None:
        remove_on_hosts(self.hosts, self.units, self.scratch)
        self.scratch = {}


def remove_on_hosts(hosts: UnitHosts, units: Sequence[LaunchUnit], dirs: dict[str, str]) -> None:
    for u in units:
        if dirs.get(u.name):
            with contextlib.suppress(ColdsnapError):
                hosts.call(u, RemoveStep(paths=(dirs[u.name],)), timeout=300)


def capture_launches(
    r: Resolved, w: Workload, units: Sequence[LaunchUnit], rb: ReceiptBuilder, *, native_wanted: bool, on_launch: Callable[[secrets.CaptureLaunch], None] | None = None,
) -> dict[str, tuple[str, dict[str, str]]]:  # fmt: skip
    """Each unit's command and environment for capture: the recipe's, with what the engine
    needs to release its memory and write its native payload, and what the driver needs to
    checkpoint it (n610, several ranks: collectives that share no device memory, over sockets
    on the interfaces placement chose). What the driver added goes in the receipt."""
    out = {}
    for u in units:
        command, env = recipe_launch(w)(u)
        launch = secrets.for_capture(command, env, given=env, serving=r.adapter.serving_credentials)
        if on_launch is not None:
            on_launch(launch)
        launched = r.adapter.prepare_launch(launch.command, launch.env, release_weights=r.driver.needs_release, native_weights=native_wanted)
        command, env = r.driver.launch_settings(*launched, adapter=r.adapter, topology=w.topology)
        if (command, env) != launched and "driver_launch" not in rb.details:  # the same for every unit
            rb.details["driver_launch"] = {"flags": command[len(launched[0]) :].split(), "env": {k: v for k, v in env.items() if launched[1].get(k) != v}}
        out[u.name] = command, env
    return out
