"""Each step carried out on this host, for a unit that runs here.

What touches a unit's process tree has to run beside it: CRIU (``/proc``, sockets, mounts, the
network lock of this host's namespace), the files the tree maps, its images, the rank's
records. :class:`LocalHost` does each step of :mod:`sparkrun_coldsnap.units.steps` here,
typed in and out; :mod:`sparkrun_coldsnap.units.agent` serves it to a coordinator on another
host. How the workload manager records its ranks on a host (sparkrun's local executor:
``integration/records.py``) is handed in as :class:`RankRecords`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sparkrun_coldsnap.units import steps as s
from sparkrun_coldsnap.units.step import Answer, Empty, Step

if TYPE_CHECKING:
    from sparkrun_coldsnap.drivers.base import SnapshotDriver


class RankRecords(Protocol):
    """How the workload manager records its ranks on this host."""

    def pid(self, name: str) -> int | None:
        """The process recorded as rank *name*, if that very process still runs."""
        ...

    def log_path(self, name: str) -> Path:
        """The log the manager shows for rank *name*."""
        ...

    def named(self, pattern: str) -> list[tuple[str, int]]:
        """Every rank recorded under a name matching the glob *pattern*: (name, recorded pid)."""
        ...

    def register(self, name: str, pid: int) -> Path:
        """Record *pid* (a process-group leader) as rank *name*; the record's path."""
        ...


def _quiet(_: str) -> None:
    pass


class LocalHost:
    """The steps, on this host. ``run(step)`` picks the method named by the step's verb."""

    def __init__(self, records: RankRecords) -> None:
        self.records = records

    def run(self, step: Step[Any]) -> Answer:
        answer: Answer = getattr(self, step.verb)(step)
        return answer

    # -- the unit's ranks ----------------------------------------------------------------------

    def root(self, step: s.RootStep) -> s.RootAnswer:
        return s.RootAnswer(pid=self.records.pid(step.name))

    def running(self, pattern: str) -> list[tuple[str, int]]:
        """The ranks recorded under names matching *pattern* whose process group leader runs
        (a restored tree included), as (name, pid).

        A rank's name holds its run's placement token, which another run of the same recipe need
        not share: the workload a restore replaces is found by the recipe's part of the name."""
        import psutil

        out = []
        for name, pid in self.records.named(pattern):
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and os.getpgid(pid) == pid:
                    out.append((name, pid))
            except (OSError, psutil.Error):
                continue
        return out

    def recorded(self, step: s.RecordedStep) -> s.RecordedAnswer:
        return s.RecordedAnswer(ranks=tuple(s.RecordedRank(name=n, pid=p) for n, p in self.running(step.pattern)))

    def abort_connections(self, step: s.AbortConnectionsStep) -> s.AbortAnswer:
        """The TCP connections of the ranks under the pattern ended at once, before they are
        stopped for a restore (host/connections.py says why)."""
        from sparkrun_coldsnap.host import connections
        from sparkrun_coldsnap.host.process_tree import tree_pids

        held = connections.held_connections(p for _, leader in self.running(step.pattern) for p in tree_pids(leader))
        return s.AbortAnswer(aborted=len(held), problems=tuple(connections.abort(held)))

    def adopt(self, step: s.AdoptStep) -> s.AdoptAnswer:
        return s.AdoptAnswer(pidfile=str(self.records.register(step.name, step.pid)))

    # -- capture ----------------------------------------------------------------------------------

    def capture_facts(self, step: s.CaptureFactsStep) -> s.CaptureFactsAnswer:
        """Whether the request's driver can capture on this host, and this host's fingerprint of
        the workload (what a capsule records and every host's admission compares with its own)."""
        from sparkrun_coldsnap.documents import settings as settings_mod
        from sparkrun_coldsnap.host import netfilter
        from sparkrun_coldsnap.host.facts import host_facts
        from sparkrun_coldsnap.units.resolved import resolve

        r = resolve(step.request.workload, settings_mod.current())
        support = r.driver.support(host_facts())
        fingerprint = r.fingerprint(step.request.workload, r.driver.checkpoint_tool_version())
        # Asked only of the hosts of a workload on several: every unit holds connections to
        # the others, which its dump locks with iptables.
        return s.CaptureFactsAnswer(supported=support.ok, reason=support.reason, fingerprint=fingerprint, missing_tools=tuple(netfilter.missing()))

    def socket_interface(self, step: s.SocketInterfaceStep) -> s.SocketInterfaceAnswer:
        from sparkrun_coldsnap.documents import settings as settings_mod
        from sparkrun_coldsnap.host.socket_iface import interface_holding

        return s.SocketInterfaceAnswer(interface=interface_holding(step.address, ssh_connection=settings_mod.current().environ.get("SSH_CONNECTION")))

    def files(self, step: s.FilesStep) -> s.FilesAnswer:
        from sparkrun_coldsnap.host import file_drift
        from sparkrun_coldsnap.host.process_tree import tree_pids

        # The rank's own log grows while it serves: a restore hands it the log again, not as captured.
        skip = [*step.skip, *([str(self.records.log_path(step.name))] if step.name else [])]
        return s.FilesAnswer(files=file_drift.record(tree_pids(step.root_pid), skip=skip))

    def dump(self, step: s.DumpStep) -> s.DumpAnswer:
        from sparkrun_coldsnap import extensions

        driver = extensions.registry().driver(step.driver)
        image = driver.dump_at_cut(step.root_pid, Path(step.images), unit=step.unit, host=step.host, progress=_quiet, leave_running=step.leave_running)
        return s.DumpAnswer(image=image)

    def pack(self, step: s.PackStep) -> s.PackAnswer:
        from sparkrun_coldsnap import extensions
        from sparkrun_coldsnap.capsule.pack import pack_unit

        images, out = Path(step.images), Path(step.out)
        compacted = extensions.registry().driver(step.driver).compact_images(images) if step.zero_pages else None
        image_bytes = sum(f.stat().st_size for f in images.rglob("*") if f.is_file())
        out.mkdir(parents=True, exist_ok=True)
        layers = pack_unit(images, step.unit, out)
        return s.PackAnswer(
            image_bytes=image_bytes,
            zero_pages=compacted,
            layers=tuple(s.PackedLayerOnHost(path=str(l.path), digest=l.digest, size=l.size, media_type=l.media_type, annotations=l.annotations) for l in layers),
        )

    # -- devices ------------------------------------------------------------------------------------

    def devices_lock(self, step: s.DevicesLockStep) -> s.DevicesLockAnswer:
        """Lock the device users of the unit's tree (a cut across hosts: every unit before any checkpoint)."""
        return s.DevicesLockAnswer(data=_driver(step.driver).lock_devices(step.root_pid))

    def devices_checkpoint(self, step: s.DevicesCheckpointStep) -> Empty:
        _driver(step.driver).checkpoint_devices(step.data)
        return Empty()

    def devices_resume(self, step: s.DevicesResumeStep) -> s.ProblemsAnswer:
        """After a cut that failed: the unit's device users back to running; what could not be."""
        return s.ProblemsAnswer(problems=tuple(_driver(step.driver).resume_devices(step.data, state=step.state)))

    def devices_restore(self, step: s.DevicesRestoreStep) -> Empty:
        _driver(step.driver).restore_devices(step.data, visible=step.visible)
        return Empty()

    def devices_unlock(self, step: s.DevicesUnlockStep) -> Empty:
        _driver(step.driver).unlock_devices(step.data)
        return Empty()

    # -- restore --------------------------------------------------------------------------------------

    def admit(self, step: s.AdmitStep) -> s.AdmitAnswer:
        """Admission of one unit of a capsule on this host: its fingerprint, its captured PIDs and
        shared files, its files, the model files here (what the rank running now holds is freed
        by its eviction, so it does not count)."""
        from sparkrun_coldsnap.compat.admission import admission
        from sparkrun_coldsnap.criu import tree as criu_tree
        from sparkrun_coldsnap.documents import settings as settings_mod
        from sparkrun_coldsnap.host.process_tree import tree_pids
        from sparkrun_coldsnap.units.resolved import resolve
        from sparkrun_coldsnap.weights import native_parts

        cfg, req = step.config, step.request
        unit = next((u for u in cfg.units if u.name == step.unit), None)
        if unit is None:
            return s.AdmitAnswer(problems=("the capsule has no unit %s (it has %s)" % (step.unit, ", ".join(u.name for u in cfg.units)),))
        r = resolve(req.workload, settings_mod.current())
        here = r.fingerprint(req.workload, r.driver.checkpoint_tool_version())
        replacing = frozenset(p for _, leader in self.running(step.pattern) for p in tree_pids(leader))
        weights = cfg.weights
        held = unit.driver_data.native_files
        if weights.native is not None and held is not None:
            # This host holds the payload files its own ranks wrote, not the other hosts'.
            weights = weights.model_copy(update={"native": native_parts.only(weights.native, held)})
        problems, choice = admission(cfg.model_copy(update={"units": (unit,), "weights": weights}), req, here, r.driver, r.adapter, replacing=replacing)
        # Restored into this host's namespaces (the ranks reach each other at the captured
        # addresses): the captured PIDs and shared files must be free here.
        problems += [p for p in criu_tree.restore_problems(unit, replacing=replacing) if p not in problems]
        if unit.driver_data.peer_connections:
            from sparkrun_coldsnap.host import netfilter

            # Restored under iptables rules: CRIU's network lock and the peer lock.
            problems += netfilter.problems("a restore across hosts")
        found = s.WeightsFound(path=choice.path, native_dir=str(choice.native_dir) if choice.native_dir else None, note=choice.note) if choice is not None else None
        tools = None if problems else r.driver.ready_tools()
        return s.AdmitAnswer(problems=tuple(problems), restore_tools=s.ToolsReady.model_validate(tools) if tools is not None else None, weights=found)

    def inbox(self, step: s.InboxStep) -> s.InboxAnswer:
        """A private directory for the layers about to be sent here."""
        from sparkrun_coldsnap.capsule.store import CapsuleStore
        from sparkrun_coldsnap.host import paths
        from sparkrun_coldsnap.host.atomic import owned_prefix

        base = paths.run_dir() / "units"
        base.mkdir(parents=True, exist_ok=True)
        received = CapsuleStore(Path(tempfile.mkdtemp(prefix=owned_prefix("inbox-"), dir=base)))
        received.blobs.mkdir(parents=True)
        # Laid out as a store's blobs are: each layer is verified as it is read, as from a store.
        return s.InboxAnswer(path=str(received.root), blobs=str(received.blobs))

    def stage(self, step: s.StageStep) -> s.StageAnswer:
        """Verify and unpack the layers sent to the inbox (memory-backed staging when there is
        room); the layers received are removed once unpacked."""
        from sparkrun_coldsnap.capsule.pack import unpack_layer
        from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor
        from sparkrun_coldsnap.host import paths
        from sparkrun_coldsnap.host.atomic import owned_prefix

        received = Path(step.inbox)
        descs = [Descriptor(media_type=d.media_type, digest=d.digest, size=d.size, annotations=dict(d.annotations) or None) for d in step.layers]
        memory = paths.memory_staging(step.unpacked_bytes)
        staging = paths.new_memory_staging(memory, owned_prefix("restore-")) if memory is not None else Path(tempfile.mkdtemp(prefix=owned_prefix("restore-"), dir=received.parent))
        try:
            written = sum(unpack_layer(CapsuleStore(received), d, staging / "units") for d in descs)
        except BaseException:
            paths.remove_staging(staging)
            raise
        finally:
            paths.remove_staging(received)
        return s.StageAnswer(staging=str(staging), images=str(staging / "units" / step.unit), bytes=written)

    def restore(self, step: s.RestoreStep) -> s.RestoreAnswer:
        details: dict[str, Any] = {}
        # It writes the rank's own log (sparkrun logs reads it).
        pid = _driver(step.image.driver).restore_at_cut(step.image, Path(step.images), log_path=self.records.log_path(step.name), progress=_quiet, zombie_wait=step.zombie_wait, details=details)
        return s.RestoreAnswer(pid=pid, details=s.RestoreMeasured.model_validate(details))

    def network_lock(self, step: s.NetworkLockStep) -> Empty:
        """Hold back the packets of the unit's connections to other hosts (host/peer_lock.py says why)."""
        from sparkrun_coldsnap.host import peer_lock

        peer_lock.lock(list(step.connections))
        return Empty()

    def network_unlock(self, step: s.NetworkUnlockStep) -> s.ProblemsAnswer:
        from sparkrun_coldsnap.host import peer_lock

        return s.ProblemsAnswer(problems=tuple(peer_lock.unlock(list(step.connections))))

    # -- the native weight payload (weights/native_parts.py) ---------------------------------------------

    def native_staging(self, step: s.NativeStagingStep) -> s.PathAnswer:
        """The directory the engine's ranks on this host write their native payload into."""
        from sparkrun_coldsnap.weights import native_parts

        return s.PathAnswer(path=str(native_parts.staging(step.token)))

    def native_part(self, step: s.NativePartStep) -> s.NativePartAnswer:
        """The payload files the ranks of this host wrote into the staging directory."""
        from sparkrun_coldsnap.weights import native_parts

        return s.NativePartAnswer(files=native_parts.part(Path(step.path)))

    def native_place(self, step: s.NativePlaceStep) -> s.NativePlaceAnswer:
        """This host's part moved under the whole payload's digest; its directory."""
        from sparkrun_coldsnap.weights import native_parts

        return s.NativePlaceAnswer(directory=str(native_parts.place(Path(step.path), step.record, list(step.names))))

    # -- the host -------------------------------------------------------------------------------------------

    def io_uring_off(self, step: s.IoUringOffStep) -> s.IoUringOffAnswer:
        from sparkrun_coldsnap.host.iouring import hold_off

        return s.IoUringOffAnswer(previous=hold_off(step.token, dict(step.coordinator) if step.coordinator is not None else None))

    def io_uring_back(self, step: s.IoUringBackStep) -> s.IoUringBackAnswer:
        from sparkrun_coldsnap.host.iouring import let_go

        return s.IoUringBackAnswer(restored=let_go(step.token))

    def drop_page_cache(self, step: s.DropPageCacheStep) -> Empty:
        from sparkrun_coldsnap.weights.page_cache import drop

        drop()
        return Empty()

    def remove(self, step: s.RemoveStep) -> Empty:
        from sparkrun_coldsnap.host import paths

        for p in step.paths:
            paths.remove_staging(Path(p))
        return Empty()


def _driver(name: str) -> SnapshotDriver:
    from sparkrun_coldsnap import extensions

    return extensions.registry().driver(name)
