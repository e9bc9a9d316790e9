"""The capsule config blob: what was captured, from what, where, and how it answered."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from sparkrun_coldsnap.documents.fingerprint import Fingerprint
from sparkrun_coldsnap.documents.request import Workload
from sparkrun_coldsnap.documents.strict import Strict
from sparkrun_coldsnap.documents.tokens import TokenRecord
from sparkrun_coldsnap.documents.unit_image import UnitImage

CAPSULE_FORMAT: Literal[1] = 1


class ModelFile(Strict):
    name: str = Field(description="Path relative to the model directory.")
    size: int
    sha256: str


class NativePayload(Strict):
    digest: str = Field(description="sha256 over the file list below; names the payload's directory under native/ in the coldsnap home.")
    files: tuple[ModelFile, ...] = Field(description="One tensor file and one index per engine worker, as the engine wrote them at capture.")


class WeightsRecord(Strict):
    location: Literal["in-image", "external"] = Field(description="in-image: the engine could not release its weights, they are inside the process images; external: hydrated from the files below.")
    model_id: str
    revision: str
    files: tuple[ModelFile, ...]
    artifact: str | None = Field(None, description="Digest of a weights artifact published to a registry, if any.")
    native: NativePayload | None = Field(None, description="The engine's loaded tensors written at capture, read back by the native weight path; none if not written.")


class CarriedCache(Strict):
    name: str = Field(description="The cache's folder under the directory, named for what fills it (vllm, torchinductor, triton, flashinfer, ...).")
    env: str = Field(description="The variable the captured engine was started with, pointing at that folder.")
    files: int
    bytes: int


class EngineCaches(Strict):
    directory: str = Field(description="Where the captured engine's caches live, the same on every host: a restore unpacks them there before the engine goes on.")
    layer: str = Field(description="Digest of the capsule layer that holds them.")
    files: int
    bytes: int
    caches: tuple[CarriedCache, ...] = Field(description="What each cache held when the engine was ready.")
    kept: tuple[str, ...] = Field((), description="Cache variables the recipe or the environment set itself: the engine kept them, the capsule does not carry those caches.")


class CapturedValidation(Strict):
    prompt: str
    max_tokens: int
    reply: str
    request_ttft_seconds: float | None = None
    tokens: TokenRecord | None = Field(
        None,
        description="The reply's token ids and log-probabilities, which a restore must reproduce within coldsnap.validation.logprob_tolerance; "
        "absent when the engine returned none (and in capsules captured before they were recorded): restores then compare the text alone.",
    )

    # No return annotation: the JSON Schema stays the fields' own. A config without a token
    # record writes back as it was read (one captured before the record existed, say).
    @model_serializer(mode="wrap")
    def _without_absent_tokens(self, handler: SerializerFunctionWrapHandler):
        out = handler(self)
        if out.get("tokens") is None:
            out.pop("tokens", None)
        return out


class EngineRecord(Strict):
    name: str
    version: str | None


class RecordsDisagree(ValueError):
    """Two records of one fact in a capsule config differ: the config was altered after capture."""


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
    engine_caches: EngineCaches | None = Field(
        None,
        description="A template capture (n580): the compile and JIT caches its engine filled after the boundary, carried as a layer of their own.",
    )
    credentials: tuple[str, ...] = Field(
        (),
        description="Names (never values) of the credentials the captured memory holds (--api-key, VLLM_API_KEY); publish refuses such a capsule unless told --allow-secrets.",
    )

    @model_serializer(mode="wrap")
    def _without_absent_caches(self, handler: SerializerFunctionWrapHandler):
        # A capsule of a driver that carries no caches is written as it was before they existed.
        out = handler(self)
        if out.get("engine_caches") is None:
            out.pop("engine_caches", None)
        return out

    @model_validator(mode="after")
    def _one_engine(self) -> CapsuleConfig:
        # The engine is recorded twice (here for people and listings, in the fingerprint for
        # admission, which compares only the fingerprint's): a config whose two records
        # disagree could be admitted on the strength of one while the other is true.
        fp = self.fingerprint
        if (self.engine.name, self.engine.version) != (fp.engine, fp.engine_version):
            raise RecordsDisagree("engine %s %s disagrees with fingerprint.engine %s %s: the config was altered; recapture" % (self.engine.name, self.engine.version, fp.engine, fp.engine_version))
        # Admission checks the recipe's revision against the fingerprint's, hydration reads the
        # files of the weights record's: a config where they differ would admit one revision and
        # serve another.
        if self.weights.revision != fp.model_revision:
            raise RecordsDisagree("weights.revision %s disagrees with fingerprint.model_revision %s: the config was altered; recapture" % (self.weights.revision, fp.model_revision))
        return self
