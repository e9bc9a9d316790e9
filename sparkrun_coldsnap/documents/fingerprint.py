"""The facts a capsule is bound to: recorded at capture, compared before a restore (``compat/fingerprint.py``)."""

from __future__ import annotations

from pydantic import Field

from sparkrun_coldsnap.documents.strict import Strict
from sparkrun_coldsnap.host.facts import GpuInfo


class TopologyFacts(Strict):
    hosts: int
    units: int
    tensor_parallel: int
    pipeline_parallel: int


class Fingerprint(Strict):
    cpu_arch: str
    cpu_features: tuple[str, ...]
    kernel_release: str
    criu_version: str | None
    nvidia_driver: str | None
    cuda_version: str | None
    gpus: tuple[GpuInfo, ...]
    engine: str
    engine_version: str | None
    python_version: str | None
    torch_version: str | None
    image_digest: str | None
    container_runtime: str | None = Field(None, description="Container runtime, its version and the settings a checkpoint depends on.")
    engine_env_digest: str | None
    model_revision: str
    topology: TopologyFacts
