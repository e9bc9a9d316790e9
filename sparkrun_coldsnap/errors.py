"""One error class per failure domain.

Every error carries a stable ``code`` (it lands in receipts and in
``--json`` output) and a one-line message that names the input at fault and
the fix. The CLI prints ``message`` and exits non-zero; tracebacks appear only
when debugging is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.receipts import Receipt


class ColdsnapError(Exception):
    """Base class: a failure the user can act on."""

    code = "coldsnap.error"
    exit_code = 1
    #: the failed (or refused) receipt of the operation that raised it, when there was one.
    receipt: Receipt | None = None
    #: the message's closing words on what a process tree was left in ("the process tree is
    #: still running"), which stop untrue once the operation stops that tree.
    tree_state: str | None = None

    def with_tree_stopped(self, stopped: str) -> str:
        """The message once the tree it describes is stopped: *stopped* in place of the tree's state."""
        head = self.message
        if self.tree_state and head.endswith("; " + self.tree_state):
            head = head[: -len(self.tree_state) - 2]
        return "%s; %s" % (head, stopped)

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.code


class RequestError(ColdsnapError):
    """The recipe, its ``coldsnap:`` block or a command-line input is invalid."""

    code = "request.invalid"
    exit_code = 2


class StoreError(ColdsnapError):
    """The capsule store cannot be read or written, or a blob is damaged."""

    code = "store.error"


class IntegrityError(StoreError):
    """A blob or manifest does not match its recorded digest."""

    code = "store.integrity"


class UntrustedStoreError(StoreError):
    """The store could have been changed by another user: restore (CRIU, as root) will not read it."""

    code = "store.untrusted"
    exit_code = 2


class NotFoundError(StoreError):
    """The named capsule, blob or reference is not in the store."""

    code = "store.not_found"
    exit_code = 4


class CompatibilityError(ColdsnapError):
    """Admission refused: this host differs from the one that captured."""

    code = "admission.refused"
    exit_code = 3


class ContradictoryCapsuleError(IntegrityError, CompatibilityError):
    """A capsule's config records one fact twice (its engine, its model revision), differently: it
    was altered after capture; refused as admission refuses a capsule (exit 3, a refused receipt)."""

    code = "store.integrity"
    exit_code = 3


class CaptureError(ColdsnapError):
    """The running workload could not be captured."""

    code = "capture.failed"


class RestoreError(ColdsnapError):
    """A capsule could not be restored into a running workload."""

    code = "restore.failed"


class ValidationError(ColdsnapError):
    """The workload answered, but not with the reply recorded at capture."""

    code = "validation.failed"


class EngineError(ColdsnapError):
    """The inference engine failed to start or to answer."""

    code = "engine.failed"
    #: the HTTP status the engine refused a request with, when it answered one
    http_status: int | None = None


class ToolError(ColdsnapError):
    """An external tool (criu, unshare, ...) is missing or failed."""

    code = "tool.failed"


class RegistryError(ColdsnapError):
    """An OCI registry refused or failed a request."""

    code = "registry.error"


def describe_cleanup_failure(primary: BaseException, cleanup: BaseException) -> str:
    """Report a cleanup failure beside the error that triggered the cleanup."""
    return "%s (cleanup also failed: %s)" % (primary, cleanup)


def coldsnap_cause(err: BaseException) -> ColdsnapError | None:
    """The plugin's own error inside an exception another layer (sparkrun) wrapped it in, if any."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, ColdsnapError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None
