"""Strict, versioned requests: everything the controller needs, nothing ambient.

A request is built once, from the recipe's ``coldsnap:`` block and sparkrun's
placement, then handed to the controller. Its digest (sha256 of canonical
JSON) names exactly what was asked for and lands in every receipt.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, SerializerFunctionWrapHandler, field_validator, model_serializer

from sparkrun_coldsnap import secrets
from sparkrun_coldsnap.digests import canonical_json, sha256_bytes
from sparkrun_coldsnap.documents.capsule_ref import CapsuleRef
from sparkrun_coldsnap.documents.strict import Strict
from sparkrun_coldsnap.documents.tokens import DEFAULT_LOGPROB_TOLERANCE
from sparkrun_coldsnap.documents.trust import TrustPolicy
from sparkrun_coldsnap.documents.values import AbsolutePath, CommandText, Device, EnvName, EnvValue, HostName, Ident, Label, PathName, Size, VolumePath, shown

REQUEST_FORMAT: Literal[1] = 1

_REVISION_RE = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")
_PINNED_IMAGE_RE = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")


def is_immutable_revision(value: str) -> bool:
    return bool(_REVISION_RE.match(value or ""))


def revision_problem(value: object) -> str | None:
    """Why a recipe's ``model_revision`` cannot bind a capsule to its weights (None: it can)."""
    if value is None or value == "":
        return "model_revision is missing: a capsule is bound to exact weights; pin the model's commit hash (model_revision: <40 hex digits>)"
    if not is_immutable_revision(str(value)):
        return "model_revision %s is not immutable: a capsule is bound to exact weights, pin the commit hash (40 hex digits)" % shown(str(value), 80)
    return None


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """Values of variables named like credentials replaced by their digest: what may be stored."""
    return secrets.redact_env(env)


class ModelRef(Strict):
    id: Label = Field(min_length=1, description="Model id, e.g. Qwen/Qwen3-8B.")
    revision: str = Field(description="Immutable revision: a 40- or 64-hex commit or content id.")
    path: AbsolutePath | None = Field(None, description="Local directory holding the model files (the weights path).")

    @field_validator("revision")
    @classmethod
    def _immutable(cls, v: str) -> str:
        if not is_immutable_revision(v):
            raise ValueError("model revision %s is not immutable: pin a commit hash (40 hex digits)" % shown(v, 80))
        return v


class LaunchUnit(Strict):
    """One engine process tree: a rank on a host."""

    name: PathName = Field(description="Unit name, e.g. 'solo' or 'rank-0'.")
    host: HostName = Field(description="Host the unit runs on.")
    rank: int = Field(0, ge=0, description="The unit's node rank: its place in the host order sparkrun placed (0 is the head).")
    devices: tuple[Device, ...] = Field((), description="Accelerator indices the unit sees; empty on CPU.")
    command: CommandText | None = Field(None, description="This unit's serve command, where units differ (a distributed engine's node rank, master address, --headless); none: launch.command.")
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, description="What this unit's environment adds to or changes in launch.env (its host's address and interfaces).")


class Topology(Strict):
    hosts: tuple[HostName, ...] = Field(min_length=1)
    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    units: tuple[LaunchUnit, ...] = Field(min_length=1)


class Launch(Strict):
    executor: Literal["local", "docker"] = Field(description="How sparkrun places the engine: host processes or containers.")
    command: CommandText = Field(min_length=1, description="Serve command as rendered by sparkrun's runtime.")
    env: dict[EnvName, EnvValue] = Field(default_factory=dict)
    port: int = Field(ge=1, le=65535)
    engine_env: PathName | None = Field(None, description="Local engine environment name (host-process workloads).")
    image: Label | None = Field(None, description="Container image pinned by digest (name@sha256:...).")
    volumes: dict[VolumePath, VolumePath] = Field(default_factory=dict, description="Container volumes, host path -> container path.")
    shm_size: Size | None = Field(None, description="Container /dev/shm size.")

    @field_validator("image")
    @classmethod
    def _pinned(cls, v: str | None) -> str | None:
        if v is not None and not _PINNED_IMAGE_RE.match(v):
            raise ValueError("container image %s is not pinned by digest: use name@sha256:<digest>" % shown(v, 200))
        return v


class Workload(Strict):
    """What runs: the identity a capsule is checked against before restore."""

    recipe: Label = Field(description="Recipe name.")
    engine: Ident = Field(description="Engine adapter name (vllm, sglang).")
    runtime: Ident = Field(description="sparkrun runtime that renders the command.")
    model: ModelRef
    topology: Topology
    launch: Launch
    driver: Ident = Field(description="Snapshot driver (cpu, n610, n580).")
    weights: Literal["auto", "native", "recovery", "in-image"] = "auto"

    def redacted(self) -> Workload:
        """This workload with credential-like env values replaced by their digest: what may be stored."""
        launch = self.launch.model_copy(update={"env": redact_env(self.launch.env), "command": secrets.redact_command(self.launch.command)})
        units = tuple(u.model_copy(update={"env": redact_env(u.env), "command": None if u.command is None else secrets.redact_command(u.command)}) for u in self.topology.units)
        return self.model_copy(update={"launch": launch, "topology": self.topology.model_copy(update={"units": units})})

    def secret_values(self) -> tuple[str, ...]:
        """The secrets this workload carries, for scrubbing free text (errors quoting a log line)."""
        env = {**self.launch.env}
        commands = [self.launch.command]
        for u in self.topology.units:
            env.update({"%s@%s" % (k, u.name): v for k, v in u.env.items()})
            commands += [u.command] if u.command is not None else []
        return secrets.values_in(env, commands)


class ValidationSpec(Strict):
    prompt: str = Field(min_length=1)
    expected_reply: str | None = None
    max_tokens: int = Field(16, ge=1, le=512)
    timeout_seconds: float = Field(120.0, gt=0)
    logprob_tolerance: float = Field(DEFAULT_LOGPROB_TOLERANCE, ge=0, description="Largest difference allowed between a restored token's log-probability and the recorded one.")

    # No return annotation: the JSON Schema stays the fields' own. At its default the tolerance
    # is left out, so a document (and its digest) made before it existed stays the same.
    @model_serializer(mode="wrap")
    def _without_default_tolerance(self, handler: SerializerFunctionWrapHandler):
        out = handler(self)
        if out.get("logprob_tolerance") == DEFAULT_LOGPROB_TOLERANCE:
            out.pop("logprob_tolerance", None)
        return out


class _WorkloadRequest(Strict):
    """What a capture and a restore both name: the workload, how to validate it, which capsule."""

    format: Literal[1] = REQUEST_FORMAT
    workload: Workload
    validation: ValidationSpec
    capsule: CapsuleRef
    ready_timeout_seconds: float = Field(900.0, gt=0)
    request_sha256: str | None = Field(None, description="The document's own digest (what --dry-run prints); when present, a run checks the document still matches it. Not part of the digest.")

    def digest(self) -> str:
        return request_digest(self)


class CaptureRequest(_WorkloadRequest):
    operation: Literal["capture"] = "capture"


class RestoreRequest(_WorkloadRequest):
    operation: Literal["restore"] = "restore"
    on_missing: Literal["vanilla", "fail"] = "vanilla"
    on_incompatible: Literal["vanilla", "fail"] = Field("vanilla", description="Admission refused: start vanilla, or fail.")
    recapture: bool = Field(False, description="After a vanilla start instead of a restore, capture again and serve from the new capsule.")
    workload_name: PathName = Field(description="Name sparkrun tracks the running workload by (its executor's record name).")
    workload_labels: dict[Label, Label] = Field(default_factory=dict, description="Container labels sparkrun's executor gives its workloads.")
    trust: TrustPolicy | None = Field(None, description="Signatures the capsule must carry (coldsnap.capsule.trust); checked before anything is stopped.")

    # No return annotation: the JSON Schema stays the fields' own. Without a policy the field is
    # left out, so a document (and its digest) made before it existed stays the same.
    @model_serializer(mode="wrap")
    def _without_unset_trust(self, handler: SerializerFunctionWrapHandler):
        out = handler(self)
        if out.get("trust") is None:
            out.pop("trust", None)
        return out


def request_digest(request: _WorkloadRequest) -> str:
    """sha256 of the canonical JSON of *request*, secrets redacted (the digest may be published)."""
    redacted = request.model_copy(update={"workload": request.workload.redacted()})
    return sha256_bytes(canonical_json(redacted.model_dump(mode="json", exclude={"request_sha256"})))
