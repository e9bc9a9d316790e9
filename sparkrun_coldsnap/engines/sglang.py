"""The SGLang adapter (bundled; registered through the plugin hooks like any other).

Before capture SGLang releases weights and KV cache through its memory saver
(``--enable-memory-saver``, ``POST /release_memory_occupation`` with those
tags; captured CUDA graphs stay, they are part of what a restore saves).
After restore it resumes the allocations and reloads the weights in place from
the model files the capsule recorded (``/update_weights_from_disk``).

Facts of SGLang's HTTP server this relies on (0.5.17): ``/health`` answers 503
until the server has warmed up, then 200 with an empty body after generating one
token (so it is polled only while weights are in place, and each poll may take seconds); the memory endpoints
answer 200 ``null`` and track released tags (resuming one not released is fatal);
``/update_weights_from_disk`` answers ``{"success": ..., "message": ...}`` with
200 or 400, and on success reports the model path as the served name.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from sparkrun_coldsnap.engines.base import Endpoint, EngineAdapter, HydrationResult, has_flag, post
from sparkrun_coldsnap.errors import EngineError
from sparkrun_coldsnap.hookspecs import hookimpl

RELEASED = ["weights", "kv_cache"]


class SglangAdapter(EngineAdapter):
    model_flags = ("--model-path", "--model")
    # /health generates one token before it answers: on a busy or cold GPU that takes seconds.
    health_timeout = 60.0
    name = "sglang"
    runtimes = ("sglang",)
    distributions = ("sglang",)
    gpu_weight_paths = ("recovery",)
    cpu_weight_paths = ()  # no CPU build of SGLang's kernels exists
    # After torch and transformers: importing the engine may open the GPU.
    template_preload = ("torch", "transformers")
    # sparkrun renders `sglang serve ...` (the console script of sglang.cli.main).
    console_scripts = {"sglang": "sglang.cli.main"}
    # Its custom all-reduce shares buffers through CUDA IPC; symmetric memory and NVLS turn
    # NCCL's cuMem handles and multicast back on (SGLang sets NCCL_CUMEM_ENABLE and
    # NCCL_NVLS_ENABLE from them at start).
    ipc_free_flags = ("--disable-custom-all-reduce",)
    ipc_flags = ("--enable-symm-mem", "--enable-nccl-nvls")

    def prepare_launch(self, command: str, env: Mapping[str, str], *, release_weights: bool, native_weights: bool = False) -> tuple[str, dict[str, str]]:
        if release_weights and not has_flag(command, "--enable-memory-saver"):
            command = command + " --enable-memory-saver"
        return command, dict(env)

    # The memory saver drops weights and KV cache together: what vLLM calls level 2.
    sleep_levels = (2,)

    def release_memory(self, endpoint: Endpoint) -> None:
        post(endpoint.base_url + "/release_memory_occupation", json_body={"tags": RELEASED}, what="SGLang release_memory_occupation")

    def hydrate(
        self, endpoint: Endpoint, *, path: str, model_dir: str, native_dir: str | None = None, cached: bool = False, memory_dir: str | None = None,
        filling: Callable[[], bool] | None = None,
    ) -> HydrationResult:  # fmt: skip
        if path != "recovery":
            raise EngineError("weight path %r is not built for SGLang: use weights: recovery (or auto)" % path)
        t = time.monotonic()
        post(endpoint.base_url + "/resume_memory_occupation", json_body={"tags": ["weights"]}, what="SGLang resume_memory_occupation(weights)")
        what = "SGLang update_weights_from_disk"
        r = post(endpoint.base_url + "/update_weights_from_disk", json_body={"model_path": model_dir}, timeout=1800, what=what, require_2xx=False)
        try:
            doc = r.json() or {}
        except ValueError:
            doc = {}
        if r.status_code != 200 or not doc.get("success"):
            raise EngineError("%s failed: HTTP %d: %s" % (what, r.status_code, doc.get("message") or r.text[:300]))
        post(endpoint.base_url + "/resume_memory_occupation", json_body={"tags": ["kv_cache"]}, what="SGLang resume_memory_occupation(kv_cache)")
        return HydrationResult("recovery", time.monotonic() - t)


@hookimpl
def register_engines(register) -> None:
    register(SglangAdapter())
