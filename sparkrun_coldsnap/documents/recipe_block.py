"""The ``coldsnap:`` block of a sparkrun recipe.

Parsed strictly: an unknown key is an error that lists the allowed ones,
because a misspelt setting silently ignored would change what gets captured.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from pydantic import ValidationError as PydanticValidationError

from sparkrun_coldsnap.documents.capsule_ref import DEFAULT_TAG, CapsuleNameField, CapsuleRef, TagField
from sparkrun_coldsnap.documents.strict import Strict, allowed_keys, one_line
from sparkrun_coldsnap.documents.tokens import DEFAULT_LOGPROB_TOLERANCE
from sparkrun_coldsnap.documents.trust import TrustPolicy
from sparkrun_coldsnap.documents.values import Ident, Label, PathName, PathText
from sparkrun_coldsnap.errors import RequestError

DEFAULT_PROMPT = "Reply with one short sentence: what is a cold start?"


class CapsuleSettings(Strict):
    name: CapsuleNameField | None = Field(None, description="Capsule name in the store; defaults to the recipe's name.")
    tag: TagField = Field(DEFAULT_TAG, description="Tag of the capsule to capture into and restore from.")
    store: PathText | None = Field(None, description="Local capsule store (an OCI image layout directory).")
    repository: Label | None = Field(None, description="OCI repository (REGISTRY/REPO[:TAG]) to pull the capsule from when it is missing locally.")
    plain_http: bool = Field(False, description="Talk to the registry over plain HTTP (a registry on loopback, say).")
    ca_file: PathText | None = Field(None, description="CA certificate bundle to verify the registry's TLS certificate with.")
    pull_weights: bool = Field(True, description="Fetch the model files from the capsule's weights artifact when they are missing here.")
    pull_native: bool = Field(True, description="Fetch the capsule's native weight payload, when it was published, with the capsule (weights: auto or native).")
    trust: TrustPolicy | None = Field(None, description="Signatures a capsule must carry to be pulled or restored: keys (PEM public keys) and require.")

    def ref(self, default_name: str) -> CapsuleRef:
        """The capsule this block names: its name, else *default_name*, and its tag."""
        return CapsuleRef(name=self.name or default_name, tag=self.tag)


class ValidationSettings(Strict):
    prompt: str = Field(DEFAULT_PROMPT, min_length=1, description="User message of the validation chat completion.")
    expected_reply: str | None = Field(None, description="Reply the workload must give; by default the one recorded at capture.")
    max_tokens: int = Field(16, ge=1, le=512, description="Tokens generated (greedily) for validation.")
    timeout_seconds: float = Field(120.0, gt=0, description="Limit for the validation request.")
    logprob_tolerance: float = Field(
        DEFAULT_LOGPROB_TOLERANCE,
        ge=0,
        description="A restore must reproduce the token ids recorded at capture exactly, and each token's log-probability within this (absolute, natural log).",
    )


class ColdsnapBlock(Strict):
    capsule: CapsuleSettings = Field(default_factory=CapsuleSettings)
    driver: Ident = Field("auto", description="Snapshot driver: auto, cpu, n610 or n580.")
    engine: Ident | None = Field(None, description="Engine adapter; defaults from the recipe's runtime (vllm, sglang).")
    engine_env: PathName | None = Field(None, description="Local engine environment (installed by `sparkrun coldsnap setup`) for host-process workloads.")
    weights: Literal["auto", "native", "recovery", "in-image"] = Field("auto", description="How weights come back after restore.")
    validation: ValidationSettings = Field(default_factory=ValidationSettings)
    on_missing: Literal["vanilla", "fail"] = Field("vanilla", description="When the capsule does not exist: start the engine vanilla, or fail.")
    on_incompatible: Literal["vanilla", "fail"] = Field(
        "vanilla",
        description="When admission refuses the capsule on this host (a library upgraded since capture, another driver or engine build): start the engine vanilla, or fail. `sparkrun coldsnap restore` always fails.",
    )
    recapture: bool = Field(False, description="After a vanilla start caused by a missing or refused capsule, capture the engine again and serve from the new capsule, so the next start restores.")
    ready_timeout_seconds: float = Field(900.0, gt=0, description="How long a vanilla engine start may take.")


def parse_block(value: Any, *, source: str = "recipe") -> ColdsnapBlock:
    """Validate a raw ``coldsnap:`` value from YAML."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise RequestError("%s: coldsnap: must be a mapping of settings, got %s" % (source, type(value).__name__))
    try:
        return ColdsnapBlock.model_validate(value)
    except PydanticValidationError as err:
        raise RequestError(one_line(err, prefix="%s: coldsnap" % source, known=allowed_keys(ColdsnapBlock))) from err
