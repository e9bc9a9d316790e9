"""The n610 driver's cut across hosts: the order of the CUDA checkpoint calls over every unit of
a workload on several hosts, and what a failure on one host does to every host.

The controller's real steps run here (``cut`` and
the agent-backed steps of ``controller/units_agent.py``) over ``FakeHosts``: two FAKE hosts
whose steps, over the real wire, call the n610 driver's own per-host functions (``cuda/units.py``)
on a FAKE of the checkpoint API per host. The fake is as strict as the driver in what
matters to the order: illegal transitions fail (``FakeCheckpointApi``), and a process that is
stopped (SIGSTOP) answers no call, since the driver's calls are carried out by the process's
own threads. The same steps run through real hosts, real CRIU and the fake CUDA driver
bindings in ``test_two_node_gpu.py``.
"""

from __future__ import annotations

import pytest
from fakes.fake_unit_hosts import FakeUnitHosts, NoRecords
from test_cuda_checkpoint import FakeCheckpointApi

from sparkrun_coldsnap.controller.cut import UnitOnHost, checkpoint_units, restore_units
from sparkrun_coldsnap.controller.units_agent import AgentCut, AgentDevices, AgentRestore
from sparkrun_coldsnap.cuda import checkpoint as cuda_checkpoint
from sparkrun_coldsnap.cuda import units as cuda_units
from sparkrun_coldsnap.documents.driver_data import DriverData
from sparkrun_coldsnap.documents.request import LaunchUnit
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.errors import CaptureError, RestoreError
from sparkrun_coldsnap.units import framing
from sparkrun_coldsnap.units.local import LocalHost
from sparkrun_coldsnap.units.step import Empty
from sparkrun_coldsnap.units.steps import DevicesLockAnswer, DumpAnswer, ProblemsAnswer, RestoreAnswer

# Each host runs one unit: its root (the API server or the headless launcher) and a rank, each
# with a CUDA context, as a tensor-parallel engine with one rank per host has.
PIDS = {"a": [100, 101], "b": [200, 201]}
UNITS = [LaunchUnit(name="rank-0", host="a", rank=0), LaunchUnit(name="rank-1", host="b", rank=1)]
# The one connection between the ranks, as each end sees it.
PEER_TCP = {"a": ("198.18.0.1", 29500, "198.18.0.2", 41000), "b": ("198.18.0.2", 41000, "198.18.0.1", 29500)}


class HostApi(FakeCheckpointApi):
    """The checkpoint API of one FAKE host: a stopped process answers nothing."""

    def __init__(self, pids, **kw):
        super().__init__(pids, **kw)
        self.stopped = False
        self.gone = False

    def _step(self, op, pid, want, to):
        self._answering(op, pid)
        super()._step(op, pid, want, to)

    def state(self, pid):
        self._answering("state", pid)
        return super().state(pid)

    def _answering(self, op, pid):
        if self.gone:
            raise cuda_checkpoint.CudaCallError("CUDA_ERROR_NOT_FOUND")
        if self.stopped:
            raise cuda_checkpoint.CudaCallHung("no answer to %s of process %d: it is stopped" % (op, pid))


class FakeHosts(FakeUnitHosts):
    """Two FAKE hosts as ``UnitHosts`` over the real wire (``fakes/fake_unit_hosts.py``): each
    step the cut uses carried out on that host's fake API, every call logged as (what, host)
    in one order."""

    def __init__(self, *, fail_verb: tuple[str, str] | None = None, dead: str | None = None, **api_failures):
        super().__init__()
        self.api = {h: HostApi(p, fail=api_failures.get(h)) for h, p in PIDS.items()}
        self.fail_verb = fail_verb  # (verb, host): the agent answers an error there
        self.dead = dead  # a host that stops answering at its first device step
        self.held: dict[str, bool] = {}  # whether the host holds back its unit's connections
        self.leave_running = False  # a cut whose dumps leave the trees running

    def host_end(self, unit, request):
        verb = framing.decode(request)["step"]
        if self.dead == unit.host and verb.startswith("devices_"):
            return 255, b""  # ssh's own failure: nothing came back
        if self.fail_verb == (verb, unit.host):
            return self.error("capture.failed", "criu dump of pid %d failed: killed" % PIDS[unit.host][0])
        return super().host_end(unit, request)

    def host(self, unit):
        return GpuHost(self, unit.host)

    def signal_group(self, unit, pid, signal):
        super().signal_group(unit, pid, signal)
        if signal in ("STOP", "CONT"):
            self.api[unit.host].stopped = signal == "STOP"

    def states(self) -> dict[str, list[str]]:
        return {h: [api.states[p] for p in PIDS[h]] for h, api in self.api.items()}


class GpuHost(LocalHost):
    """One FAKE host's end of the steps the cut uses, on its fake API."""

    USED = {"devices_lock", "devices_checkpoint", "devices_resume", "devices_restore", "devices_unlock", "network_lock", "network_unlock", "dump", "restore", "remove"}

    def __init__(self, hosts: FakeHosts, host: str):
        super().__init__(NoRecords())
        self.hosts, self.name, self.api = hosts, host, hosts.api[host]

    def run(self, step):
        assert step.verb in self.USED, "step %s is not one the cut uses" % step.verb
        return super().run(step)

    def devices_lock(self, step):
        cuda_checkpoint.lock_all(self.api, PIDS[self.name])
        return DevicesLockAnswer(data={"cuda_pids": PIDS[self.name], "gpu_uuids": ["GPU-%s" % self.name], "host_gpu_uuids": ["GPU-%s" % self.name]})

    def devices_checkpoint(self, step):
        cuda_units.checkpoint(self.api, step.data)
        return Empty()

    def devices_resume(self, step):
        data = step.data if step.data.cuda_pids else step.data.merged(DriverData(cuda_pids=tuple(PIDS[self.name])))
        return ProblemsAnswer(problems=tuple(cuda_units.resume(self.api, data, state=step.state)))

    def devices_restore(self, step):
        self.api.uuids = lambda h=self.name: ["GPU-%s" % h]  # type: ignore[method-assign]
        cuda_units.restore(self.api, step.data, visible=step.visible)
        return Empty()

    def devices_unlock(self, step):
        cuda_units.unlock(self.api, step.data)
        return Empty()

    def network_lock(self, step):
        assert [list(c) for c in step.connections] == [list(c) for c in image(self.name).driver_data.peer_tcp]
        self.hosts.held[self.name] = True
        return Empty()

    def network_unlock(self, step):
        assert [list(c) for c in step.connections] == [list(c) for c in image(self.name).driver_data.peer_tcp]
        self.hosts.held[self.name] = False
        return ProblemsAnswer(problems=())

    def dump(self, step):
        self.api.gone = not (step.leave_running or self.hosts.leave_running)  # a capture's dump ends the tree
        return DumpAnswer(image=image(self.name))

    def restore(self, step):  # CRIU: the tree back, stopped at the cut, its processes checkpointed
        self.api.gone, self.api.stopped = False, True
        self.api.states = dict.fromkeys(PIDS[self.name], "checkpointed")
        return RestoreAnswer(pid=PIDS[self.name][0])

    def remove(self, step):
        return Empty()


def image(host: str) -> UnitImage:
    pids = tuple(PIDS[host])
    return UnitImage(name="rank-0" if host == "a" else "rank-1", host=host, driver="n610", root_pid=pids[0], pids=pids, pid_namespace=False,
                     driver_data={"cuda_pids": list(pids), "gpu_uuids": ["GPU-%s" % host], "host_gpu_uuids": ["GPU-%s" % host],
                                  "peer_tcp": [list(PEER_TCP[host])]})  # fmt: skip


def cut(hosts: FakeHosts, *, resume: bool = False):
    by_name = {u.name: u for u in UNITS}
    targets = [UnitOnHost(u.name, u.host, PIDS[u.host][0], "/images/%s" % u.name) for u in UNITS]
    return checkpoint_units(AgentCut(hosts, by_name, "n610"), targets, resume=resume, devices=AgentDevices(hosts, by_name, "n610"))


def positions(log, what) -> list[int]:
    return [i for i, (step, _) in enumerate(log) if step == what]


def test_every_unit_is_locked_before_any_checkpoint_and_every_checkpoint_comes_before_any_stop_or_dump():
    hosts = FakeHosts()
    done = cut(hosts)
    log = hosts.log
    locks, checkpoints, stops, dumps = (positions(log, s) for s in ("devices_lock", "devices_checkpoint", "STOP", "dump"))
    assert len(locks) == len(checkpoints) == len(stops) == len(dumps) == 2
    assert max(locks) < min(checkpoints) and max(checkpoints) < min(stops) and max(stops) < min(dumps)
    assert not positions(log, "CONT") and not positions(log, "devices_resume")  # a capture's dumps end the trees
    assert {name: data.model_dump(mode="json") for name, data in done.devices.items()} == {"rank-0": {"cuda_pids": [100, 101], "gpu_uuids": ["GPU-a"], "host_gpu_uuids": ["GPU-a"]},
                            "rank-1": {"cuda_pids": [200, 201], "gpu_uuids": ["GPU-b"], "host_gpu_uuids": ["GPU-b"]}}  # fmt: skip
    assert set(done.barriers) == {"locked", "checkpointed", "quiesced", "dumped", "resumed"}
    assert set(done.phases["rank-1"]) == {"lock", "device_checkpoint", "quiesce", "dump"}


def test_a_cuda_checkpoint_that_fails_on_one_host_puts_every_cuda_process_of_every_host_back_to_running():
    hosts = FakeHosts(b={("checkpoint", 201): "CUDA_ERROR_OUT_OF_MEMORY"})
    with pytest.raises(CaptureError) as err:
        cut(hosts)
    message = err.value.message
    assert "\n" not in message and message.startswith("checkpointing the devices of unit rank-1 on host b: CUDA checkpoint of process 201")
    assert "CUDA_ERROR_OUT_OF_MEMORY" in message and "with its devices back to running and nothing was kept" in message, message
    assert hosts.states() == {"a": ["running", "running"], "b": ["running", "running"]}
    assert not positions(hosts.log, "STOP") and not positions(hosts.log, "dump")  # nothing was stopped or dumped
    # host a had checkpointed both: restored each, then unlocked each
    assert hosts.api["a"].calls[-4:] == [("restore", 100), ("restore", 101), ("unlock", 100), ("unlock", 101)]


def test_a_dump_that_fails_on_one_host_continues_that_unit_then_puts_its_cuda_processes_back():
    hosts = FakeHosts(fail_verb=("dump", "b"))
    with pytest.raises(CaptureError, match=r"^dumping unit rank-1 on host b: criu dump of pid 200 failed: killed; every unit still running was resumed with its devices back"):
        cut(hosts)
    assert hosts.states()["b"] == ["running", "running"]
    assert hosts.log.index(("CONT", "b")) < hosts.log.index(("devices_resume", "b"))  # a stopped process answers no CUDA call
    assert ("devices_resume", "a") not in hosts.log and ("CONT", "a") not in hosts.log  # its dump ended its tree


def test_a_dump_that_fails_on_one_host_resumes_every_cuda_process_on_every_host_when_the_cut_leaves_them_running():
    hosts = FakeHosts(fail_verb=("dump", "b"))
    hosts.api["a"].gone = False
    hosts.leave_running = True  # a cut whose dumps leave the trees running
    with pytest.raises(CaptureError, match="every unit was resumed as it was with its devices back to running and nothing was kept$"):
        cut(hosts, resume=True)
    assert hosts.states() == {"a": ["running", "running"], "b": ["running", "running"]}
    for h in ("a", "b"):
        assert hosts.log.index(("CONT", h)) < hosts.log.index(("devices_resume", h))


def test_a_host_that_stops_answering_at_the_lock_fails_the_cut_naming_it_and_the_other_host_is_unlocked():
    hosts = FakeHosts(dead="b")
    with pytest.raises(CaptureError) as err:
        cut(hosts)
    message = err.value.message
    assert message.startswith("locking the devices of unit rank-1 on host b: step devices_lock gave no answer"), message
    assert "resuming failed for putting back the devices of unit rank-1 on host b: step devices_resume gave no answer" in message  # still unreachable, and said so
    assert hosts.states()["a"] == ["running", "running"] and not positions(hosts.log, "devices_checkpoint")


def restore_steps(hosts: FakeHosts) -> AgentRestore:
    return AgentRestore(hosts, {"rank-0": image("a"), "rank-1": image("b")}, {"rank-0": "/staged/0", "rank-1": "/staged/1"}, "n610")


def test_a_restore_gives_every_host_its_gpus_back_before_any_host_unlocks():
    hosts = FakeHosts()
    roots: dict[str, int] = {}
    done = restore_units(restore_steps(hosts), UNITS, roots, devices=True)
    order = ["network_lock", "restore", "network_unlock", "adopt", "CONT", "devices_restore", "devices_unlock"]
    spans = [positions(hosts.log, s) for s in order]
    assert all(len(s) == 2 for s in spans)
    assert all(max(a) < min(b) for a, b in zip(spans, spans[1:])), hosts.log
    assert roots == {"rank-0": 100, "rank-1": 200} and hosts.states() == {"a": ["running", "running"], "b": ["running", "running"]}
    assert list(done.barriers) == ["network_held", "restored", "network_open", "adopted", "continued", "devices_restored", "unlocked"]
    assert hosts.held == {"a": False, "b": False}


@pytest.mark.parametrize("failing", ["network_lock", "restore"])
def test_a_unit_that_cannot_hold_back_its_connections_or_be_restored_leaves_no_host_holding_them_back(failing):
    hosts = FakeHosts(fail_verb=(failing, "b"))
    with pytest.raises(RestoreError, match="unit rank-1 on host b"):
        restore_units(restore_steps(hosts), UNITS, {}, devices=True)
    assert hosts.held.get("a") is False and not hosts.held.get("b"), hosts.log  # a locked, then lifted; b lifted or never locked
    assert ("network_unlock", "a") in hosts.log and not positions(hosts.log, "adopt")
    if failing == "network_lock":
        assert not positions(hosts.log, "restore")  # nothing was restored with a host not holding back


def test_a_cuda_restore_that_fails_on_one_host_unlocks_no_host_and_names_it():
    hosts = FakeHosts(b={("restore", 201): "CUDA_ERROR_INVALID_VALUE"})
    roots: dict[str, int] = {}
    with pytest.raises(RestoreError, match=r"^restoring the devices of unit rank-1 on host b: CUDA restore of process 201 .*CUDA_ERROR_INVALID_VALUE"):
        restore_units(restore_steps(hosts), UNITS, roots, devices=True)
    assert not positions(hosts.log, "devices_unlock")
    assert roots == {"rank-0": 100, "rank-1": 200}  # known to the caller, which ends both trees
    assert hosts.states()["a"] == ["locked", "locked"]  # back on its GPU, never let run alone


def test_a_cpu_unit_restore_has_no_device_steps():
    hosts = FakeHosts()
    restore_units(restore_steps(hosts), UNITS, {}, devices=False)
    assert [s for s, _ in hosts.log if s.startswith("devices_")] == []


def test_a_driver_that_cannot_cut_across_hosts_is_refused_in_one_line_naming_those_that_can(tmp_path, use_settings):
    from test_launch_units import two_host_workload

    from sparkrun_coldsnap.controller.admit import resolve_across_hosts
    from sparkrun_coldsnap.errors import RequestError

    settings = use_settings()
    for driver in ("cpu", "n610"):
        assert resolve_across_hosts(two_host_workload(tmp_path).model_copy(update={"driver": driver}), settings).driver.across_hosts
    with pytest.raises(RequestError) as err:
        resolve_across_hosts(two_host_workload(tmp_path).model_copy(update={"driver": "n580"}), settings)
    assert err.value.code == "request.multi_host" and "\n" not in err.value.message
    assert err.value.message.startswith("driver n580 cannot capture a workload of several hosts (n610, cpu can): set coldsnap.driver to one of those")
