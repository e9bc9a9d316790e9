"""sparkrun's placement of a multi-host run turned into launch units, against sparkrun's own parts.

The recipe, the ``vllm-distributed`` runtime that renders each host's command, the rank
placement, the probed hardware and the communication environment are sparkrun 0.4.2's real
classes; only the activation context that carries them is assembled here: sparkrun builds it
inside ``sparkrun run``, which reaches the plugin for a multi-host run on CPU hosts once the
plugin's platform gives them a collective backend (the last test, on the two hosts of
tests/two_hosts.py).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
from conftest import ROOT, write_recipe
from sparkrun.core.hardware import AcceleratorSpec, HostHardware
from sparkrun.core.recipe import Recipe
from sparkrun.core.scheduler import RankAssignment, RankSlot
from sparkrun.orchestration.comm_env import ClusterCommEnv
from sparkrun.runtimes.vllm_distributed import VllmDistributedRuntime
from sparkrun.runtimes.vllm_ray import VllmRayRuntime

from sparkrun_coldsnap import api
from sparkrun_coldsnap.documents.request import CapsuleRef, CaptureRequest, Launch, ModelRef, RestoreRequest, Topology, ValidationSpec, Workload
from sparkrun_coldsnap.errors import RequestError
from sparkrun_coldsnap.integration import cpu_platform
from sparkrun_coldsnap.integration.launch_units import env_delta, node_commands, units_of

HOSTS = ("198.18.0.1", "198.18.0.2")
COMMON = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "NCCL_CUMEM_ENABLE": "0"}
CPU = HostHardware(accelerators=[AcceleratorSpec(vendor="cpu", model="cpu", capabilities=frozenset({"cpu"}))])


def distributed_recipe(tmp_path) -> Recipe:
    path = write_recipe(
        tmp_path,
        name="two-hosts.yaml",
        replace={"runtime: vllm\n": "runtime: vllm-distributed\n", "--dtype {dtype}": "--dtype {dtype} --tensor-parallel-size {tensor_parallel}"},
    )
    return Recipe.load(path)


def activation(tmp_path, *, hosts=HOSTS, runtime=None, ranks_per_host=1, hardware=CPU, comm: ClusterCommEnv | None = None, overrides=None):
    """What sparkrun hands a strategy, with sparkrun's own recipe, runtime and placement inside."""
    slots = tuple(RankSlot(host=h, local_gpu=g) for h in hosts for g in range(ranks_per_host))
    plan = SimpleNamespace(
        recipe=distributed_recipe(tmp_path), runtime=runtime or VllmDistributedRuntime(),
        placement=RankAssignment(by_rank=slots, hosts_used=tuple(hosts)), host_hardware={h: hardware for h in hosts},
    )  # fmt: skip
    options = SimpleNamespace(overrides=overrides if overrides is not None else {"tensor_parallel": len(slots)}, init_port=25000)
    return SimpleNamespace(execution=SimpleNamespace(plan=plan, options=options), hosts=tuple(hosts), comm_env=comm)


def test_one_unit_per_host_in_rank_order_with_sparkruns_node_command(tmp_path):
    comm = ClusterCommEnv(per_host={h: {"NODE_IP": h, "GLOO_SOCKET_IFNAME": "eth0"} for h in HOSTS})
    units = units_of(activation(tmp_path, comm=comm), COMMON)
    assert [(u.name, u.host, u.rank) for u in units] == [("rank-0", HOSTS[0], 0), ("rank-1", HOSTS[1], 1)]
    head, worker = units
    assert head.command is not None and head.command.endswith("--nnodes 2 --node-rank 0 --master-addr %s --master-port 25000" % HOSTS[0])
    assert worker.command is not None and worker.command.endswith("--nnodes 2 --node-rank 1 --master-addr %s --master-port 25000 --headless" % HOSTS[0])
    assert "--tensor-parallel-size 2" in head.command and head.command.startswith("python -m vllm.entrypoints.openai.api_server")
    # Each unit adds its host's address and interface (vLLM advertises NODE_IP as VLLM_HOST_IP).
    for unit, host in zip(units, HOSTS):
        assert unit.env == {"NODE_IP": host, "GLOO_SOCKET_IFNAME": "eth0", "VLLM_HOST_IP": host}
        assert unit.devices == ()  # the plugin's CPU slot is no device


def test_a_rank_whose_host_sparkrun_found_no_address_for_advertises_the_one_it_was_placed_at(tmp_path):
    # sparkrun's detection reports NODE_IP only on InfiniBand hosts; without it vLLM's worker
    # reaches the head's scheduler queue at 0.0.0.0 and waits forever.
    comm = ClusterCommEnv(per_host={h: {"GLOO_SOCKET_IFNAME": "eth0"} for h in HOSTS})
    for comm_env in (comm, None):
        for unit, host in zip(units_of(activation(tmp_path, comm=comm_env), COMMON), HOSTS):
            assert unit.env["NODE_IP"] == unit.env["VLLM_HOST_IP"] == host
    # A host named by its DNS name is not an address to advertise: left to vLLM.
    named = units_of(activation(tmp_path, hosts=("node-a", "node-b"), comm=None), COMMON)
    assert all("VLLM_HOST_IP" not in u.env for u in named)


def test_the_commands_are_the_runtimes_own(tmp_path):
    actx = activation(tmp_path)
    plan = actx.execution.plan
    expected = node_commands(plan.runtime, plan.recipe, {"tensor_parallel": 2}, HOSTS, init_port=25000, placement=plan.placement)
    assert [u.command for u in units_of(actx, COMMON)] == expected
    assert expected[1].endswith("--headless") and not expected[0].endswith("--headless")


def test_gpu_hosts_get_the_devices_placement_gave_them(tmp_path):
    gpus = HostHardware(accelerators=[AcceleratorSpec(vendor="nvidia", model="GB10", count=2)])
    units = units_of(activation(tmp_path, ranks_per_host=2, hardware=gpus), COMMON)
    assert [u.devices for u in units] == [("0", "1"), ("0", "1")]


def test_a_solo_placement_is_the_one_unit_it_always_was(tmp_path):
    (unit,) = units_of(activation(tmp_path, hosts=HOSTS[:1], overrides={}), COMMON)
    assert unit.model_dump() == {"name": "solo", "host": HOSTS[0], "rank": 0, "devices": (), "command": None, "env": {}}


def test_a_runtime_that_does_not_start_one_engine_per_host_is_refused(tmp_path):
    with pytest.raises(RequestError, match="runtime vllm-ray starts its workers through ray, not one engine per host"):
        units_of(activation(tmp_path, runtime=VllmRayRuntime()), COMMON)


def test_a_unit_environment_is_the_common_one_plus_its_own():
    assert env_delta({"A": "1", "B": "2"}, {"A": "1", "B": "3", "C": "4"}) == {"B": "3", "C": "4"}
    with pytest.raises(RequestError, match="lacks B of the workload's common environment"):
        env_delta({"A": "1", "B": "2"}, {"A": "1"})


def two_host_workload(tmp_path) -> Workload:
    units = units_of(activation(tmp_path, comm=ClusterCommEnv(per_host={h: {"NODE_IP": h} for h in HOSTS})), COMMON)
    units = (units[0], units[1].model_copy(update={"env": {**units[1].env, "HF_TOKEN": "hf_secret_value"}}))
    return Workload(
        recipe="two-hosts", engine="vllm", runtime="vllm-distributed", model=ModelRef(id="coldsnap/tiny-qwen2", revision="ab" * 20),
        topology=Topology(hosts=HOSTS, tensor_parallel=2, units=units), launch=Launch(executor="local", command="python -m vllm.entrypoints.openai.api_server", env=COMMON, port=8000),
        driver="cpu",
    )  # fmt: skip


def test_a_request_of_units_validates_against_its_schema_and_keeps_unit_secrets_out(tmp_path):
    req = CaptureRequest(workload=two_host_workload(tmp_path), validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="two-hosts"))
    doc = req.model_dump(mode="json")
    jsonschema.validate(doc, json.loads((ROOT / "docs" / "schemas" / "capture-request.schema.json").read_text()))
    assert CaptureRequest.model_validate(doc) == req
    assert "hf_secret_value" in req.workload.secret_values()
    stored = req.workload.redacted().model_dump(mode="json")
    assert "hf_secret_value" not in json.dumps(stored) and stored["topology"]["units"][1]["env"]["HF_TOKEN"].startswith("sha256:")


def test_a_request_document_of_several_units_is_refused_in_one_line_naming_the_way_through_sparkrun(tmp_path):
    workload = two_host_workload(tmp_path)
    capture = CaptureRequest(workload=workload, validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="two-hosts"))
    with pytest.raises(RequestError) as err:
        api.capture(capture, store=tmp_path / "store")
    assert err.value.code == "request.multi_host"
    assert err.value.message.startswith("a request document of several launch units cannot be run as it is: the recipe places 2 (rank-0 on 198.18.0.1, rank-1 on 198.18.0.2)")
    assert "capture the recipe through sparkrun (sparkrun coldsnap capture RECIPE --cluster NAME" in err.value.message
    restore = RestoreRequest(workload=workload, validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="two-hosts"), workload_name="w")
    with pytest.raises(RequestError, match=r"^a request document of several launch units cannot be run as it is: the recipe places 2 ") as err:
        api.prepare(restore, store=tmp_path / "store")
    assert "\n" not in err.value.message


def test_sparkrun_picks_gloo_for_hosts_with_the_cpu_slot():
    """The plugin's platform claims the CPU slot, so sparkrun's own selection finds a collective."""
    from sparkrun.core.backend_select import select_backends, validate_collective_backends

    cpu_platform.register()
    bundle = select_backends(CPU)
    assert (bundle.accelerator_vendor, bundle.collective.name) == ("cpu", "gloo")
    validate_collective_backends({h: bundle for h in HOSTS})
    assert bundle.collective.env_for_host({"IB_DETECTED": "0"}) == {}
    assert bundle.collective.env_for_host({"DETECTED_SOCKET_IFNAME": "eth0", "DETECTED_MGMT_IP": "198.18.0.1"}) == {"GLOO_SOCKET_IFNAME": "eth0", "NODE_IP": "198.18.0.1"}


def test_sparkrun_places_a_multi_host_cpu_run_and_the_plugin_makes_one_unit_per_host(two_node, sparkrun, tmp_path, store):
    """sparkrun 0.4.2 picks a collective backend for any launch of more than one rank; with the
    plugin's gloo platform it has one for the CPU slot, and its placement reaches the plugin."""
    recipe = write_recipe(
        tmp_path,
        name="two-hosts.yaml",
        replace={"runtime: vllm\n": "runtime: vllm-distributed\n", "--dtype {dtype}": "--dtype {dtype} --tensor-parallel-size {tensor_parallel}"},
    )
    cp = sparkrun.coldsnap("capture", str(recipe), "--cluster", "two-node", "-o", "tensor_parallel=2", "--store", str(store), "--dry-run")
    request = json.loads(cp.stdout[cp.stdout.index("{\n") :])
    units = request["workload"]["topology"]["units"]
    assert [(u["name"], u["host"]) for u in units] == [("rank-0", two_node.addresses[0]), ("rank-1", two_node.addresses[1])]
    assert "--node-rank 0 --master-addr %s" % two_node.addresses[0] in units[0]["command"] and "--headless" not in units[0]["command"]
    assert units[1]["command"].endswith("--node-rank 1 --master-addr %s --master-port 25000 --headless" % two_node.addresses[0])


def _capsule_of(workload):
    from types import SimpleNamespace

    return SimpleNamespace(config=SimpleNamespace(workload=workload))


def test_a_placement_other_than_the_captured_one_is_named_unit_by_unit(tmp_path):
    from sparkrun_coldsnap.controller.restore_hosts import refuse_topology, topology_problems
    from sparkrun_coldsnap.errors import CompatibilityError

    captured = two_host_workload(tmp_path)
    a, b = captured.topology.units
    swapped = captured.model_copy(update={"topology": captured.topology.model_copy(update={"units": (a.model_copy(update={"host": b.host}), b.model_copy(update={"host": a.host}))})})
    req = RestoreRequest(workload=swapped, validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="two-hosts"), workload_name="w")
    assert topology_problems(_capsule_of(captured), req) == [
        "unit rank-0 ran on host %s at capture, the run places it on host %s" % (a.host, b.host),
        "unit rank-1 ran on host %s at capture, the run places it on host %s" % (b.host, a.host),
    ]
    with pytest.raises(CompatibilityError) as err:
        refuse_topology(_capsule_of(captured), req)
    assert err.value.code == "compatibility.topology" and "\n" not in err.value.message
    assert "run on the captured hosts in rank order (-H %s,%s)" % (a.host, b.host) in err.value.message
    solo = captured.model_copy(update={"topology": captured.topology.model_copy(update={"units": (a.model_copy(update={"name": "solo"}),)})})
    one = RestoreRequest(workload=solo, validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="two-hosts"), workload_name="w")
    assert topology_problems(_capsule_of(captured), one) == ["the capsule has 2 units (rank-0 on %s, rank-1 on %s), the run places 1 (solo on %s)" % (a.host, b.host, a.host)]
    same = RestoreRequest(workload=captured, validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="two-hosts"), workload_name="w")
    assert topology_problems(_capsule_of(captured), same) == []


class _Cut:
    """A cut whose second unit's dump fails, recording what was done to each unit."""

    def __init__(self):
        self.done = []

    def stop(self, u):
        self.done.append(("stop", u.unit))

    def dump(self, u):
        if u.unit == "rank-1":
            from sparkrun_coldsnap.errors import CaptureError

            raise CaptureError("dumping unit rank-1 on host b: criu was killed")
        self.done.append(("dump", u.unit))
        return u.unit

    def resume(self, u):
        self.done.append(("resume", u.unit))

    def discard(self, u):
        self.done.append(("discard", u.unit))


def test_a_capture_cut_whose_dump_fails_resumes_what_runs_and_keeps_nothing():
    from sparkrun_coldsnap.controller.cut import UnitOnHost, checkpoint_units
    from sparkrun_coldsnap.errors import CaptureError

    cut = _Cut()
    units = [UnitOnHost("rank-0", "a", 10, "/i0"), UnitOnHost("rank-1", "b", 20, "/i1")]
    with pytest.raises(CaptureError) as err:
        checkpoint_units(cut, units, resume=False)
    assert err.value.message == "dumping unit rank-1 on host b: criu was killed; every unit still running was resumed and nothing was kept"
    assert cut.done[:2] == [("stop", "rank-0"), ("stop", "rank-1")]  # every unit stopped before any dump
    assert {("resume", "rank-1"), ("discard", "rank-0"), ("discard", "rank-1")} <= set(cut.done)
    assert ("resume", "rank-0") not in cut.done  # its dump ended its tree: nothing of it runs to continue
    ok = _Cut()
    ok.dump = lambda u: u.unit  # type: ignore[method-assign]
    done = checkpoint_units(ok, units, resume=False)
    assert done.dumped == {"rank-0": "rank-0", "rank-1": "rank-1"} and not any(step == "resume" for step, _ in ok.done)
