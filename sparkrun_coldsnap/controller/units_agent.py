"""The coordinated checkpoint's and restore's steps, each on the unit's host through its agent.

``cut`` says in which order the steps run over
the units; these classes say how one step reaches one unit: a typed step of
``units/steps.py`` run on the unit's host (``UnitHosts.call``), or a signal to the unit's
process group there. A failure names the step, the unit and its host in one line.
"""

from __future__ import annotations

from sparkrun_coldsnap.controller.cut import UnitOnHost
from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.documents.request import LaunchUnit
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.errors import CaptureError, ColdsnapError, RestoreError
from sparkrun_coldsnap.launch.remote import UnitHosts
from sparkrun_coldsnap.units.step import Answer, Step
from sparkrun_coldsnap.units.steps import (
    DevicesCheckpointStep,
    DevicesLockStep,
    DevicesRestoreStep,
    DevicesResumeStep,
    DevicesUnlockStep,
    DumpStep,
    NetworkLockStep,
    NetworkUnlockStep,
    RemoveStep,
    RestoreMeasured,
    RestoreStep,
)  # fmt: skip

#: seconds an agent may take for one device step: a lock waits for work in flight (its own
#: timeout, per process), a checkpoint or restore copies device memory (minutes for large ones)
DEVICE_STEP_SECONDS = {"devices_lock": 900.0, "devices_checkpoint": 1800.0, "devices_resume": 1800.0, "devices_restore": 1800.0, "devices_unlock": 300.0}


class AgentCut:
    """The cut's steps on each unit's process tree (``cut.Cut``)."""

    def __init__(self, hosts: UnitHosts, units: dict[str, LaunchUnit], driver: str) -> None:
        self.hosts, self.units, self.driver = hosts, units, driver

    def stop(self, u: UnitOnHost) -> None:
        self.hosts.signal_group(self.units[u.unit], u.root_pid, "STOP")

    def resume(self, u: UnitOnHost) -> None:
        self.hosts.signal_group(self.units[u.unit], u.root_pid, "CONT")

    def dump(self, u: UnitOnHost) -> UnitImage:
        step = DumpStep(root_pid=u.root_pid, images=u.images, unit=u.unit, host=u.host, driver=self.driver)
        try:
            return self.hosts.call(self.units[u.unit], step, timeout=1800).image
        except ColdsnapError as err:
            raise CaptureError("dumping %s" % err.message) from err

    def discard(self, u: UnitOnHost) -> None:
        self.hosts.call(self.units[u.unit], RemoveStep(paths=(u.images,)), timeout=300)


class AgentDevices:
    """The cut's steps on each unit's device state (``cut.DeviceSteps``);
    keeps what each unit's lock recorded, which every later step of that unit is given."""

    def __init__(self, hosts: UnitHosts, units: dict[str, LaunchUnit], driver: str) -> None:
        self.hosts, self.units, self.driver = hosts, units, driver
        self.data: dict[str, DriverData] = {}

    def _step[A: Answer](self, unit: LaunchUnit, step: Step[A], what: str) -> A:
        try:
            return self.hosts.call(unit, step, timeout=DEVICE_STEP_SECONDS[step.verb])
        except ColdsnapError as err:
            raise CaptureError("%s %s" % (what, err.message)) from err

    def lock(self, u: UnitOnHost) -> DriverData:
        data = self._step(self.units[u.unit], DevicesLockStep(driver=self.driver, root_pid=u.root_pid), "locking the devices of").data
        self.data[u.unit] = data
        return data

    def checkpoint(self, u: UnitOnHost) -> None:
        self._step(self.units[u.unit], DevicesCheckpointStep(driver=self.driver, data=self.data[u.unit]), "checkpointing the devices of")

    def put_back(self, u: UnitOnHost, state: str) -> list[str]:
        # A unit whose lock did not answer has no record here: its host finds the tree's
        # device users again from the root (a lock never closes their device files).
        data = DriverData(root_pid=u.root_pid).merged(self.data.get(u.unit, DriverData()))
        return list(self._step(self.units[u.unit], DevicesResumeStep(driver=self.driver, data=data, state=state), "putting back the devices of").problems)


class AgentRestore:
    """The restore's steps on each unit (``cut.RestoreSteps``), from the images
    each host staged."""

    def __init__(self, hosts: UnitHosts, images: dict[str, UnitImage], staged: dict[str, str], driver: str) -> None:
        self.hosts, self.images, self.staged, self.driver = hosts, images, staged, driver
        #: what each unit's host measured of its restore, by unit name
        self.details: dict[str, RestoreMeasured] = {}

    def restore(self, u: LaunchUnit) -> int:
        step = RestoreStep(image=self.images[u.name], images=self.staged[u.name], name=self.hosts.rank_name(u))
        try:
            answer = self.hosts.call(u, step, timeout=1800)
        except ColdsnapError as err:
            raise RestoreError("restoring %s" % err.message) from err
        self.details[u.name] = answer.details
        return answer.pid

    def _network_step(self, u: LaunchUnit, lock: bool, what: str) -> None:
        held = self.images[u.name].driver_data.peer_tcp or ()
        if not held:
            return  # no connection to another host's unit
        try:
            if lock:
                self.hosts.call(u, NetworkLockStep(connections=held), timeout=300)
                problems: tuple[str, ...] = ()
            else:
                problems = self.hosts.call(u, NetworkUnlockStep(connections=held), timeout=300).problems
        except ColdsnapError as err:
            raise RestoreError("%s %s" % (what, err.message)) from err
        if problems:
            raise RestoreError("%s unit %s on host %s: %s" % (what, u.name, u.host, "; ".join(problems)))

    def lock_network(self, u: LaunchUnit) -> None:
        self._network_step(u, True, "holding back the connections of")

    def unlock_network(self, u: LaunchUnit) -> None:
        self._network_step(u, False, "letting through the connections of")

    def adopt(self, u: LaunchUnit, root: int) -> None:
        self.hosts.adopt(u, root)

    def resume(self, u: LaunchUnit, root: int) -> None:
        self.hosts.signal_group(u, root, "CONT")

    def _device_step[A: Answer](self, u: LaunchUnit, step: Step[A], what: str) -> None:
        try:
            self.hosts.call(u, step, timeout=DEVICE_STEP_SECONDS[step.verb])
        except ColdsnapError as err:
            raise RestoreError("%s %s" % (what, err.message)) from err

    def restore_devices(self, u: LaunchUnit) -> None:
        # The GPUs placement gave the unit on its host, when it named them (the CUDA_VISIBLE_DEVICES
        # its rank is started with); else the host's own setting picks them.
        step = DevicesRestoreStep(driver=self.driver, data=self.images[u.name].driver_data, visible=",".join(u.devices) or None)
        self._device_step(u, step, "restoring the devices of")

    def unlock_devices(self, u: LaunchUnit) -> None:
        self._device_step(u, DevicesUnlockStep(driver=self.driver, data=self.images[u.name].driver_data), "unlocking the devices of")
