"""An engine whose weights are local and pinned is started with the hub client offline.

Left online, vLLM's start on a machine without a network spends tens of seconds asking the
hub about the model, request after request. The container path hands the engine only the
workload's environment, so the launcher itself has to say it; a recipe's own value stays.
"""

from __future__ import annotations

from sparkrun_coldsnap.documents.request import Launch, LaunchUnit, ModelRef, Topology, Workload
from sparkrun_coldsnap.launch.containers import Containers, container_spec
from sparkrun_coldsnap.launch.host_processes import HostProcesses

IMAGE = "coldsnap/vllm-cpu:0.32.0@sha256:" + "ab" * 32


def workload(tmp_path, *, executor: str, env: dict[str, str] | None = None, local: bool = True) -> Workload:
    model = tmp_path / "models--coldsnap--tiny-qwen2"
    model.mkdir(exist_ok=True)
    return Workload(
        recipe="tiny", engine="vllm", runtime="vllm", driver="cpu",
        model=ModelRef(id="coldsnap/tiny-qwen2", revision="97" * 20, path=str(model) if local else None),
        topology=Topology(hosts=("localhost",), units=(LaunchUnit(name="solo", host="localhost"),)),
        launch=Launch(executor=executor, command="python -m vllm.entrypoints.openai.api_server --model coldsnap/tiny-qwen2", env=env or {}, port=8000,
                      image=IMAGE if executor == "docker" else None, volumes={str(model): "/models"} if executor == "docker" else {}),
    )  # fmt: skip


def docker_env_args(w: Workload) -> list[str]:
    """The ``-e`` arguments of the ``docker create`` a bench's vanilla start (and a capture's start) runs."""
    env = Containers().engine_env(w, None, {"HOME": "/root"})
    args = container_spec(w, w.launch.command, env).create_args("sparkrun_x_solo")
    return [args[i + 1] for i, a in enumerate(args) if a == "-e"]


def test_a_container_of_a_local_pinned_model_gets_the_hub_offline(tmp_path):
    given = docker_env_args(workload(tmp_path, executor="docker", env={"VLLM_CPU_KVCACHE_SPACE": "1"}))
    assert given == ["HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "VLLM_CPU_KVCACHE_SPACE=1"]


def test_a_recipe_that_sets_the_hub_mode_keeps_its_value(tmp_path):
    given = docker_env_args(workload(tmp_path, executor="docker", env={"HF_HUB_OFFLINE": "0"}))
    assert "HF_HUB_OFFLINE=0" in given and "HF_HUB_OFFLINE=1" not in given and "TRANSFORMERS_OFFLINE=1" in given


def test_a_model_not_on_this_host_leaves_the_hub_reachable(tmp_path):
    assert docker_env_args(workload(tmp_path, executor="docker", local=False)) == []


def test_host_processes_get_the_same_and_keep_what_the_environment_sets(tmp_path):
    local = HostProcesses()
    env = local.engine_env(workload(tmp_path, executor="local"), None, {"PATH": "/usr/bin"})
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    env = local.engine_env(workload(tmp_path, executor="local"), None, {"PATH": "/usr/bin", "TRANSFORMERS_OFFLINE": "0"})
    assert env["TRANSFORMERS_OFFLINE"] == "0" and env["HF_HUB_OFFLINE"] == "1"
