"""Hibernate: capture the LIVE workload into a capsule (no fresh engine start), then stop it.

The capture story (``api.capture`` with a live workload) from the point the engine serves (validate,
write the native weights, release device memory, precheck, record files, checkpoint, pack,
publish), told against the running tree sparkrun has registered instead of one the capture
starts. What differs is what a failure leaves: the workload. Nothing ever stops it before the
capsule is published; a failed checkpoint leaves it running (CRIU resumes the tree), and on
GPUs memory released for the checkpoint is taken back.
"""

from __future__ import annotations

from pathlib import Path

from sparkrun_coldsnap.api import CaptureOutcome, LiveWorkload, capture
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents.capsule_config import NativePayload
from sparkrun_coldsnap.documents.request import CaptureRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.launch.local import StartedUnit
from sparkrun_coldsnap.progress import QUIET, Progress


def hibernate(
    req: CaptureRequest, *, root_pid: int, log_path: Path, store: CapsuleStore, settings: Settings | None = None, progress: Progress = QUIET,
    native: NativePayload | None = None,
) -> CaptureOutcome:  # fmt: skip
    """Capture the workload serving at *root_pid* into capsule ``req.capsule`` of *store*, then stop
    it; *native* is the payload of the capsule it came back from, kept if still intact."""
    live = LiveWorkload(StartedUnit(root_pid, None, log_path), log_path, native)
    return capture(req, store=store, settings=settings, progress=progress, live=live)
