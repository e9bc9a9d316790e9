"""Start the engine the ordinary way (no capsule): launch, wait, validate."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from sparkrun_coldsnap.controller.common import Attempt, ServingOutcome, finish, require_one_unit, validate, wait_ready
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.errors import RestoreError, ValidationError
from sparkrun_coldsnap.host.ports import port_holder
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.units.resolved import resolve


def start_vanilla(
    req: RestoreRequest, *, log_path: Path, settings: Settings | None = None, progress: Progress = QUIET, on_started: Callable[[int], None] | None = None,
    because: str | None = None,
) -> ServingOutcome:  # fmt: skip
    """Start the engine the ordinary way (no capsule, or one refused: *because* says why), wait, validate."""
    settings = settings or settings_mod.current()
    rb = ReceiptBuilder("start", request_sha256=req.digest())
    if because:
        rb.details["instead_of_restore"] = because
    w = req.workload
    rb.secrets = req.workload.secret_values()
    with settings_mod.using(settings), Attempt(rb) as attempt:
        require_one_unit(w, "restore")
        r = resolve(w, settings)
        holder = port_holder(w.launch.port)
        if holder:
            raise RestoreError("port %d is in use by %s: stop that workload first" % (w.launch.port, holder))
        env = r.launcher.engine_env(w, r.engine_env, settings.environ)
        progress.step("starting %s vanilla" % w.engine)
        endpoint = r.adapter.endpoint(w.launch.command, w.model.id, w.launch.port)
        with rb.phase("launch"):
            t0 = time.monotonic()
            unit = attempt.running = r.launcher.start(w, w.launch.command, env, log_path=log_path, name=req.workload_name, labels=req.workload_labels)
            root_pid = unit.root_pid
            if on_started is not None:
                on_started(root_pid)
        wait_ready(r, endpoint, unit, rb, progress, req.ready_timeout_seconds)
        with rb.phase("validate"):
            validation = validate(r, endpoint, req, t0, req.validation.expected_reply)
        rb.validation = validation
        if not validation.passed:
            raise ValidationError("the engine replied %r, the recipe expects %r" % (validation.reply, validation.expected_reply))
        rb.details["root_pid"] = root_pid
        return ServingOutcome(finish(rb, None), root_pid, validation.ttft_seconds, unit)
