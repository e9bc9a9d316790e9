"""The compatibility fingerprint recorded at capture, and admission before restore.

Restoring a process image onto a host that differs in what the process
depends on (CPU instructions it chose kernels for, kernel, CRIU, driver, GPU,
engine build, model) fails in ways that are slow to diagnose, or worse,
answers wrongly. Admission compares every recorded fact with the host at hand
and names every mismatch at once, before anything is stopped or started.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sparkrun_coldsnap.documents.fingerprint import Fingerprint, TopologyFacts
from sparkrun_coldsnap.host.facts import GpuInfo


@dataclass(frozen=True)
class Mismatch:
    field: str
    captured: object
    here: object

    def __str__(self) -> str:
        return "%s: captured %s, here %s" % (self.field, _show(self.captured), _show(self.here))


def _show(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, (tuple, list)):
        return "[%s]" % ", ".join(_show(v) for v in value) if value else "none"
    if isinstance(value, GpuInfo):
        return "%s (sm %s)" % (value.name, value.compute_capability)
    if isinstance(value, TopologyFacts):
        return "%d host(s), %d unit(s), tp %d, pp %d" % (value.hosts, value.units, value.tensor_parallel, value.pipeline_parallel)
    return str(value)


def _same(field: str) -> Callable[[Fingerprint, Fingerprint], list[Mismatch]]:
    def check(cap: Fingerprint, here: Fingerprint) -> list[Mismatch]:
        a, b = getattr(cap, field), getattr(here, field)
        return [] if a == b else [Mismatch(field, a, b)]

    return check


def _features(cap: Fingerprint, here: Fingerprint) -> list[Mismatch]:
    missing = sorted(set(cap.cpu_features) - set(here.cpu_features))
    return [Mismatch("cpu_features", "has " + ", ".join(missing), "lacks them")] if missing else []


def _gpus(cap: Fingerprint, here: Fingerprint) -> list[Mismatch]:
    # Compare model and capability per GPU, not identity: restoring onto another
    # GPU of the same model is supported through device remapping.
    a = sorted((g.name, g.compute_capability) for g in cap.gpus)
    b = sorted((g.name, g.compute_capability) for g in here.gpus)
    out = []
    if len(a) != len(b):
        out.append(Mismatch("gpu_count", len(a), len(b)))
    elif a != b:
        out.append(Mismatch("gpus", cap.gpus, here.gpus))
    return out


def _inside_image(field: str) -> Callable[[Fingerprint, Fingerprint], list[Mismatch]]:
    """A fact about the engine inside a container image: a capsule that did not record it
    (captured before the image was probed) is bound to it by the image digest alone."""
    same = _same(field)

    def check(cap: Fingerprint, here: Fingerprint) -> list[Mismatch]:
        if getattr(cap, field) is None and cap.image_digest is not None and cap.image_digest == here.image_digest:
            return []
        return same(cap, here)

    return check


# Fields compared by a rule of their own; every other field of the fingerprint must be equal,
# so a field added to the model is checked without anyone remembering to.
SPECIAL_CHECKS: dict[str, Callable[[Fingerprint, Fingerprint], list[Mismatch]]] = {
    "cpu_features": _features,
    "gpus": _gpus,
    **{name: _inside_image(name) for name in ("engine_version", "python_version", "torch_version", "engine_env_digest")},
}


def checks() -> tuple[Callable[[Fingerprint, Fingerprint], list[Mismatch]], ...]:
    return tuple(SPECIAL_CHECKS.get(name) or _same(name) for name in Fingerprint.model_fields)


def compare(captured: Fingerprint, here: Fingerprint) -> list[Mismatch]:
    """Every way *here* differs from *captured* that a restore cannot absorb."""
    out: list[Mismatch] = []
    for check in checks():
        out.extend(check(captured, here))
    return out
