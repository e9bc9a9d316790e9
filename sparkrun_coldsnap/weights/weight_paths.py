"""Which weight path a capture prepares for and a restore takes.

native: the engine's own loaded tensors, written at capture (native_payload.py) and read
straight back; recovery: the engine reloads the model files in place. ``auto`` takes
native when this host holds the capsule's payload intact, and says why when it does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sparkrun_coldsnap.documents.capsule_config import CapsuleConfig, ModelFile
from sparkrun_coldsnap.documents.request import Workload
from sparkrun_coldsnap.drivers.base import SnapshotDriver
from sparkrun_coldsnap.engines.base import EngineAdapter
from sparkrun_coldsnap.weights import container_mounts, native_payload

if TYPE_CHECKING:
    from sparkrun_coldsnap.weights.weights_memory import StagingJob, WeightsInMemory


def writes_native(w: Workload, driver: SnapshotDriver, adapter: EngineAdapter) -> bool:
    """Whether capture writes a native weight payload: weights leave the capsule, the
    adapter has the path, the recipe did not ask for recovery only, and the engine runs
    on this host or in a container that mounts the payload's directory (container_mounts.py)."""
    return driver.needs_release and "native" in adapter.gpu_weight_paths and w.weights in ("auto", "native") and w.launch.executor in ("local", "docker")


@dataclass(frozen=True)
class WeightChoice:
    """How this restore brings weights back, decided before the old workload stops."""

    path: str  # native | recovery
    native_dir: Path | None = None
    note: str | None = None  # why auto did not take native
    problem: str | None = None  # what refuses the restore
    cached: bool = False  # preparation read the files into the page cache
    in_memory: WeightsInMemory | None = None  # preparation copied the payload into memory
    pending: StagingJob | None = None  # that copy still under way (a node with nothing prepared)

    def release_memory(self) -> None:
        if self.pending is not None:
            self.pending.discard()
        if self.in_memory is not None:
            self.in_memory.release()

    def copied_whole(self) -> bool:
        """Wait for a copy into memory still under way; whether it ended whole."""
        return self.settled().in_memory is not None

    def settled(self) -> WeightChoice:
        """This choice once a copy into memory still under way has ended (in memory, or not)."""
        return self.pending.result() if self.pending is not None else self


def source_files(cfg: CapsuleConfig, path: str) -> tuple[ModelFile, ...]:
    """What hydration by *path* reads: the native payload's files, or the recorded model files."""
    if path == "native":
        return cfg.weights.native.files if cfg.weights.native is not None else ()
    return cfg.weights.files


def files_to_read(cfg: CapsuleConfig, choice: WeightChoice, model_dir: str | None) -> list[Path]:
    """Where on this host the files hydration by *choice* will read are."""
    where = choice.native_dir if choice.path == "native" else (Path(model_dir) if model_dir else None)
    return [where / f.name for f in source_files(cfg, choice.path)] if where is not None else []


def choose(cfg: CapsuleConfig, wanted: str, adapter: EngineAdapter) -> WeightChoice:
    """auto takes native when the adapter has it and this host holds the capsule's payload intact."""
    if wanted not in ("auto", *adapter.gpu_weight_paths):
        return WeightChoice(wanted, problem="weights: %s is not a weight path of %s (it has: %s)" % (wanted, adapter.name, ", ".join(adapter.gpu_weight_paths)))
    if wanted == "recovery" or (wanted == "auto" and "native" not in adapter.gpu_weight_paths):
        return WeightChoice("recovery")
    record = cfg.weights.native
    missing = ["the capsule has no native weight payload"] if record is None else native_payload.problems(record)
    container = cfg.units[0].driver_data.container if len(cfg.units) == 1 else None
    unmounted = container_mounts.problem(container.weights_volumes) if container is not None else None
    if unmounted is not None:
        missing.insert(0, unmounted)
    if record is not None and not missing:
        return WeightChoice("native", native_payload.directory(record))
    if wanted == "native":
        return WeightChoice("native", problem="weights: native: %s; restore with weights: auto or recovery, or capture again on this host" % missing[0])
    return WeightChoice("recovery", note=missing[0])
