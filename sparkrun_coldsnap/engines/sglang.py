"""The SGLang adapter (bundled; registered through the plugin hooks like any other).

Before capture SGLang releases its device memory through its memory saver
(``--enable-memory-saver``, ``POST /release_memory_occupation``). After
restore it resumes the allocations (``/resume_memory_occupation``) and the
weights are reloaded in place from the model files the capsule recorded
(``/update_weights_from_disk``).
"""

from __future__ import annotations

import time
from typing import Mapping

from sparkrun_coldsnap.engines.base import EngineAdapter, Endpoint, HydrationResult, has_flag, timed_post
from sparkrun_coldsnap.errors import EngineError
from sparkrun_coldsnap.hookspecs import hookimpl


class SglangAdapter(EngineAdapter):
    name = "sglang"
    runtimes = ("sglang",)
    distributions = ("sglang",)
    gpu_weight_paths = ("recovery",)
    cpu_weight_paths = ()  # no CPU build of SGLang's kernels exists
    template_preload = ("torch", "transformers")

    def prepare_launch(self, command: str, env: Mapping[str, str], *, release_weights: bool) -> tuple[str, dict[str, str]]:
        if release_weights and not has_flag(command, "--enable-memory-saver"):
            command = command + " --enable-memory-saver"
        return command, dict(env)

    def release_memory(self, endpoint: Endpoint) -> None:
        timed_post(endpoint.base_url + "/release_memory_occupation", json_body={}, what="SGLang release_memory_occupation")

    def hydrate(self, endpoint: Endpoint, *, path: str, model_dir: str) -> HydrationResult:
        if path != "recovery":
            raise EngineError("SGLang weight path %r is not supported: use recovery" % path)
        t = time.monotonic()
        timed_post(endpoint.base_url + "/resume_memory_occupation", json_body={}, what="SGLang resume_memory_occupation")
        timed_post(endpoint.base_url + "/update_weights_from_disk", json_body={"model_path": model_dir}, what="SGLang update_weights_from_disk")
        return HydrationResult("recovery", time.monotonic() - t)


@hookimpl
def register_engines(register) -> None:
    register(SglangAdapter())
