"""The capsule config blob: what was captured, from what, where, and how it answered."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sparkrun_coldsnap.compat import Fingerprint
from sparkrun_coldsnap.drivers.base import UnitImage
from sparkrun_coldsnap.request import Workload
from sparkrun_coldsnap.strict import Strict

CAPSULE_FORMAT = 1


class ModelFile(Strict):
    name: str = Field(description="Path relative to the model directory.")
    size: int
    sha256: str


class WeightsRecord(Strict):
    location: Literal["in-image", "external"] = Field(
        description="in-image: the engine could not release its weights, they are inside the process images; external: hydrated from the files below."
    )
    model_id: str
    revision: str
    files: tuple[ModelFile, ...]
    artifact: str | None = Field(None, description="Digest of a weights artifact published to a registry, if any.")


class CapturedValidation(Strict):
    prompt: str
    max_tokens: int
    reply: str
    request_ttft_seconds: float | None = None


class EngineRecord(Strict):
    name: str
    version: str | None


class CapsuleConfig(Strict):
    format: Literal[1] = CAPSULE_FORMAT
    name: str
    tag: str
    created: str
    request_sha256: str
    workload: Workload
    fingerprint: Fingerprint
    engine: EngineRecord
    driver: str
    validation: CapturedValidation
    weights: WeightsRecord
    units: tuple[UnitImage, ...]
