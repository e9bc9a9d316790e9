"""One JSON receipt per operation, written atomically.

A receipt is the durable answer to "what happened": which request, which
capsule, how long each phase took (and the unaccounted rest), whether the
restored workload answered correctly, and the error if any.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from sparkrun_coldsnap import __version__, secrets
from sparkrun_coldsnap.documents.strict import Strict
from sparkrun_coldsnap.documents.tokens import TokenCheck, TokenRecord
from sparkrun_coldsnap.errors import ColdsnapError
from sparkrun_coldsnap.host.atomic import write_bytes

RECEIPT_FORMAT: Literal[1] = 1

State = Literal["succeeded", "failed", "refused"]


class Phase(Strict):
    name: str
    seconds: float = Field(ge=0)


class Validation(Strict):
    passed: bool
    ttft_seconds: float | None = Field(None, description="Seconds from activation to the first non-empty streamed token.")
    request_ttft_seconds: float | None = Field(None, description="Seconds from sending the validation request to its first token (at capture: of the same request asked again, the engine warm).")
    reply: str | None = None
    expected_reply: str | None = None
    tokens: TokenRecord | None = Field(None, description="The reply's token ids and log-probabilities, when the engine returned them (a capture records these).")
    token_check: TokenCheck | None = Field(None, description="At restore: the reply's tokens against the ones the capsule recorded.")


class ErrorInfo(Strict):
    code: str
    message: str
    phase: str | None = Field(None, description="The phase that was running when the operation failed, else the last one that ran (its result was refused).")


class Weights(Strict):
    path: Literal["in-image", "native", "recovery", "engine-load", "none"] = Field(description="in-image: inside the process images; native/recovery: hydrated after restore; engine-load: the engine loaded them itself (template).")
    seconds: float | None = None
    files: int | None = None
    bytes: int | None = None
    note: str | None = Field(None, description="Why auto did not take the native path, when it did not.")


class Receipt(Strict):
    format: Literal[1] = RECEIPT_FORMAT
    operation: str
    state: State
    request_sha256: str | None = None
    capsule: str | None = Field(None, description="Manifest digest of the capsule captured or restored.")
    capsule_ref: str | None = None
    started_at: str
    finished_at: str
    total_seconds: float
    phases: tuple[Phase, ...] = ()
    unaccounted_seconds: float = 0.0
    validation: Validation | None = None
    weights: Weights | None = None
    error: ErrorInfo | None = None
    host: str = Field(default_factory=socket.gethostname)
    tool_version: str = __version__
    details: dict[str, Any] = Field(default_factory=dict)


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="milliseconds")


class ReceiptBuilder:
    """Collects phase timings and outcome while an operation runs."""

    def __init__(self, operation: str, *, request_sha256: str | None = None) -> None:
        self.operation = operation
        self.request_sha256 = request_sha256
        self.capsule: str | None = None
        self.capsule_ref: str | None = None
        self.validation: Validation | None = None
        self.weights: Weights | None = None
        self.details: dict[str, Any] = {}
        self._phases: list[Phase] = []
        self.failed_phase: str | None = None
        #: secret values the operation's workload carries: never written into the receipt.
        self.secrets: tuple[str, ...] = ()
        self._wall0 = time.time()
        self._t0 = time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.monotonic()
        try:
            yield
        except BaseException:
            # Phases nest (a step inside a phase): the innermost one that failed names the failure.
            self.failed_phase = self.failed_phase or name
            raise
        finally:
            self._phases.append(Phase(name=name, seconds=round(time.monotonic() - t, 4)))

    def phase_seconds(self, name: str) -> float:
        return sum(p.seconds for p in self._phases if p.name == name)

    @property
    def phases(self) -> tuple[Phase, ...]:
        return tuple(self._phases)

    def finish(self, state: State, error: BaseException | None = None) -> Receipt:
        total = time.monotonic() - self._t0
        accounted = sum(p.seconds for p in self._phases)
        info = None
        if error is not None:
            code = error.code if isinstance(error, ColdsnapError) else "internal.error"
            phase = self.failed_phase or (self._phases[-1].name if self._phases else None)
            info = ErrorInfo(code=code, message=str(error) or type(error).__name__, phase=phase)
        receipt = Receipt(
            operation=self.operation,
            state=state,
            request_sha256=self.request_sha256,
            capsule=self.capsule,
            capsule_ref=self.capsule_ref,
            started_at=_iso(self._wall0),
            finished_at=_iso(time.time()),
            total_seconds=round(total, 4),
            phases=tuple(self._phases),
            unaccounted_seconds=round(max(total - accounted, 0.0), 4),
            validation=self.validation,
            weights=self.weights,
            error=info,
            details=self.details,
        )
        if not self.secrets:
            return receipt
        # An error may quote an engine's log line, which may echo its arguments.
        text = secrets.scrub(receipt.model_dump_json(), [json.dumps(s)[1:-1] for s in self.secrets])
        return Receipt.model_validate_json(text)


def write_receipt(receipt: Receipt, path: Path) -> Path:
    # Not for other users: a receipt names hosts, paths and the validation exchange.
    write_bytes(Path(path), (json.dumps(receipt.model_dump(mode="json"), indent=2) + "\n").encode(), mode=0o640)
    return Path(path)


def receipt_path(explicit: Path | None, receipts_dir: Path, name: str, receipt: Receipt) -> Path:
    """Where a receipt goes: the path asked for, else ``<store>/receipts/<capsule>/<time>-<operation>.json``."""
    if explicit:
        return Path(explicit)
    stamp = receipt.started_at.replace(":", "").replace("-", "").replace("+00:00", "Z").replace("+0000", "Z")
    return Path(receipts_dir) / name / ("%s-%s.json" % (stamp, receipt.operation))


def save_receipt(receipt: Receipt, explicit: Path | None, receipts_dir: Path, name: str) -> Path:
    """Write *receipt* where asked (*explicit*), else into the store's receipts for capsule *name*."""
    return write_receipt(receipt, receipt_path(explicit, receipts_dir, name, receipt))


def save_failure_receipt(err: ColdsnapError, explicit: Path | None, receipts_dir: Path, name: str) -> Path | None:
    """Write the receipt a failed operation left on *err*, if any; a receipt that cannot be
    written does not hide the failure it describes."""
    if err.receipt is None:
        return None
    try:
        return save_receipt(err.receipt, explicit, receipts_dir, name)
    except ColdsnapError:
        return None
