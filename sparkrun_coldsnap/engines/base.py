"""What an engine adapter does: launch flags, readiness, validation, memory release and hydration."""

from __future__ import annotations

import shlex
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from sparkrun_coldsnap.engines.openai_stream import StreamedReply, stream_chat, wait_until_ok
from sparkrun_coldsnap.errors import EngineError

if TYPE_CHECKING:
    from sparkrun_coldsnap.engines.serving_bench import ServingBench


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    served_model: str
    #: the key the engine was told to check (``--api-key``): validation requests carry it
    api_key: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class HydrationResult:
    path: str  # "recovery" | "native" | "in-image"
    seconds: float
    #: what the engine reported (per worker: bytes, seconds, direct I/O), for the receipt
    details: tuple[dict[str, Any], ...] = ()


def flag_value(command: str, flag: str) -> str | None:
    """Value of ``--flag VALUE`` or ``--flag=VALUE`` in a shell command line."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def has_flag(command: str, flag: str) -> bool:
    try:
        argv = shlex.split(command)
    except ValueError:
        return False
    return any(a == flag or a.startswith(flag + "=") for a in argv)


class EngineAdapter(ABC):
    """One inference engine (vLLM, SGLang) as the controller needs to see it."""

    name: ClassVar[str]
    #: sparkrun runtime names whose workloads this adapter handles.
    runtimes: ClassVar[tuple[str, ...]]
    #: distribution names whose installed version is the engine's version.
    distributions: ClassVar[tuple[str, ...]]
    health_path: ClassVar[str] = "/health"
    #: how long one readiness poll may take (an engine that generates a token to answer needs longer).
    health_timeout: ClassVar[float] = 2.0
    #: weight paths after restore, on GPUs (on the CPU weights stay in the image).
    gpu_weight_paths: ClassVar[tuple[str, ...]] = ()
    #: the engine reads a native payload copied into memory by mapping it (hydrate's *memory_dir*)
    maps_native: ClassVar[bool] = False
    #: weight paths on the CPU (weights stay in the process images there).
    cpu_weight_paths: ClassVar[tuple[str, ...]] = ("in-image",)
    #: modules a pre-CUDA template imports before its boundary (n580 driver).
    template_preload: ClassVar[tuple[str, ...]] = ()
    #: the variables that place the engine's compile and JIT caches, and the name of each cache's
    #: folder: a template capture (n580) points them into the capsule's cache directory. What the
    #: engine's libraries read, whichever engine: Inductor, Triton, FlashInfer's JIT workspace
    #: (the library adds ``.cache/flashinfer`` beneath), PyTorch's C++ extensions, and the CUDA
    #: driver's cache of PTX compiled for the GPU.
    compile_caches: ClassVar[dict[str, str]] = {
        "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
        "TRITON_CACHE_DIR": "triton",
        "FLASHINFER_WORKSPACE_BASE": "flashinfer",
        "TORCH_EXTENSIONS_DIR": "torch_extensions",
        "CUDA_CACHE_PATH": "cuda",
    }
    #: console scripts and the module each one runs, for the template launcher.
    console_scripts: ClassVar[dict[str, str]] = {}
    #: the serve flags that name the model (a repo id or a directory) and pin its revision.
    #: variables the engine serves with (an API key it checks): a capture keeps them, and the capsule names them
    serving_credentials: ClassVar[tuple[str, ...]] = ()
    model_flags: ClassVar[tuple[str, ...]] = ("--model",)
    revision_flag: ClassVar[str] = "--revision"
    #: Several GPU ranks (cuda/ranks.py): flags that keep the engine's own collectives
    #: from sharing device memory between ranks (added when missing), flags that make them
    #: share it (refused), and environment that does the same as the flags added.
    ipc_free_flags: ClassVar[tuple[str, ...]] = ()
    ipc_flags: ClassVar[tuple[str, ...]] = ()
    ipc_free_env: ClassVar[dict[str, str]] = {}
    #: chat completion fields that make the engine return, with the validation reply, each
    #: generated token's id and log-probability (the token oracle). vLLM and SGLang both take
    #: these; an engine that ignores them answers without a record, and its restores compare text.
    token_fields: ClassVar[dict[str, Any]] = {"logprobs": True, "top_logprobs": 1, "return_token_ids": True}
    #: the engine's own serving benchmark client (``bench --load``); None: the plugin drives none for it
    serving_bench: ClassVar[ServingBench | None] = None
    #: the engine's workers can destroy their NCCL communicators before the CUDA checkpoint and
    #: make them again after it (``detach_communicators``/``attach_communicators``), for
    #: ``COLDSNAP_COMMUNICATORS=rebuild`` (cuda/ranks.py)
    rebuilds_communicators: ClassVar[bool] = False

    # -- identity -------------------------------------------------------

    def version(self, packages: Mapping[str, str]) -> str | None:
        for dist in self.distributions:
            if dist in packages:
                return packages[dist]
        return None

    def served_model(self, command: str, model_id: str) -> str:
        return flag_value(command, "--served-model-name") or model_id

    def endpoint(self, command: str, model_id: str, port: int) -> Endpoint:
        return Endpoint("http://127.0.0.1:%d" % port, self.served_model(command, model_id), flag_value(command, "--api-key"))

    # -- launch ---------------------------------------------------------

    def prepare_launch(self, command: str, env: Mapping[str, str], *, release_weights: bool, native_weights: bool = False) -> tuple[str, dict[str, str]]:
        """Adjust the command/env so the engine can release memory before capture
        (and, with *native_weights*, write and read a native weight payload)."""
        return command, dict(env)

    def wait_ready(self, endpoint: Endpoint, *, alive: Callable[[], bool], timeout: float, on_tick: Callable[[float], None] | None = None) -> float:
        return wait_until_ok(endpoint.base_url + self.health_path, deadline_seconds=timeout, alive=alive, on_tick=on_tick, request_timeout=self.health_timeout)

    def validate(self, endpoint: Endpoint, *, prompt: str, max_tokens: int, timeout: float) -> StreamedReply:
        reply = stream_chat(endpoint.base_url, endpoint.served_model, prompt, max_tokens=max_tokens, timeout=timeout, extra=self.token_fields, api_key=endpoint.api_key)
        if not reply.text:
            raise EngineError("the engine at %s answered the validation prompt with an empty reply" % endpoint.base_url)
        return reply

    # -- GPU memory around capture --------------------------------------

    @abstractmethod
    def release_memory(self, endpoint: Endpoint) -> None:
        """Drop weights and KV cache from device memory before capture."""

    @abstractmethod
    def hydrate(
        self, endpoint: Endpoint, *, path: str, model_dir: str, native_dir: str | None = None, cached: bool = False, memory_dir: str | None = None,
        filling: Callable[[], bool] | None = None,
    ) -> HydrationResult:  # fmt: skip
        """Bring weights back after restore by *path*: recovery (from *model_dir*) or native (from *native_dir*);
        *cached*: preparation read the files into the page cache (so direct I/O would go around it);
        *memory_dir*: preparation copied the native payload there, into memory (``maps_native`` adapters);
        *filling*: that copy is still under way (its files filled as their marks say,
        weights/fill_marks.py); calling it waits for the copy to end and says whether it is whole."""

    def finish_hydration(self, endpoint: Endpoint, result: HydrationResult) -> tuple[dict[str, Any], ...]:
        """Once the restored engine has answered: let go of what *result*'s hydration kept for
        speed (a mapping still registered with the GPU, say); what each worker reported."""
        return ()

    # -- sleeping in place (lifecycle) ---------------------------------

    #: what ``sleep`` can do: 1 keeps the weights in host memory and drops the KV cache, 2 drops
    #: both (the weights come back from the model files on ``wake``). Empty: the engine cannot sleep.
    sleep_levels: ClassVar[tuple[int, ...]] = ()

    def sleep(self, endpoint: Endpoint, level: int) -> None:
        """Release accelerator memory in place at *level* (one of ``sleep_levels``)."""
        if level not in self.sleep_levels:
            raise EngineError("%s cannot sleep at level %d (its levels: %s)" % (self.name, level, ", ".join(map(str, self.sleep_levels)) or "none"))
        self.release_memory(endpoint)

    def is_sleeping(self, endpoint: Endpoint) -> bool | None:
        """Whether the engine says it is asleep (None: it has no way to say)."""
        return None

    def wake(self, endpoint: Endpoint, level: int, *, model_dir: str) -> HydrationResult:
        """Take back what ``sleep`` at *level* released; weights dropped come back from *model_dir*."""
        return self.hydrate(endpoint, path="recovery", model_dir=model_dir)

    # -- communicators around the CUDA checkpoint (several GPU ranks) ----

    def communicator_launch(self, command: str, env: Mapping[str, str]) -> tuple[str, dict[str, str]]:
        """The command and environment that let the workers rebuild their communicators
        (``rebuilds_communicators`` adapters)."""
        raise self._cannot_rebuild()

    def detach_communicators(self, endpoint: Endpoint) -> tuple[dict[str, Any], ...]:
        """Every worker destroys its NCCL communicators (the engine asleep); what each reported."""
        raise self._cannot_rebuild()

    def attach_communicators(self, endpoint: Endpoint) -> tuple[dict[str, Any], ...]:
        """Every worker makes again the communicators it detached (after the unlock, before the wake)."""
        raise self._cannot_rebuild()

    def _cannot_rebuild(self) -> EngineError:
        return EngineError("%s cannot rebuild its NCCL communicators around a CUDA checkpoint" % self.name)

    def export_native(self, endpoint: Endpoint, directory: str) -> tuple[dict[str, Any], ...]:
        """Have the serving engine write its loaded weights to *directory* (one file set per worker)."""
        raise EngineError("%s cannot write a native weight payload: use weights: recovery" % self.name)

    def capabilities(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "runtimes": list(self.runtimes),
            "weight_paths": {"cpu": list(self.cpu_weight_paths), "gpu": list(self.gpu_weight_paths)},
        }


def post(url: str, *, json_body: Any = None, timeout: float = 600.0, what: str, require_2xx: bool = True):
    """POST (a connection of its own); returns the response, and requires 2xx unless told not to."""
    import requests

    try:
        r = requests.post(url, json=json_body, timeout=timeout, headers={"Connection": "close"})
    except requests.RequestException as err:
        raise EngineError("%s failed: %s" % (what, err)) from err
    if require_2xx and not 200 <= r.status_code < 300:
        refused = EngineError("%s failed: HTTP %d: %s" % (what, r.status_code, r.text[:300]))
        refused.http_status = r.status_code  # the engine answered: it refused, it did not break mid-way
        raise refused
    return r
