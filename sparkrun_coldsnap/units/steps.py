"""Every step the coordinator asks of a unit's host, one request and one answer model each.

The host end carries them out in :mod:`sparkrun_coldsnap.units.local`; the wire is
:mod:`sparkrun_coldsnap.units.framing`. Paths are the host's own (strings: they name files
on the unit's host, not here). A unit's driver data is its record's own model
(:class:`~sparkrun_coldsnap.documents.driver_data.DriverData`); what a host measured for the
receipt is a model where the coordinator reads it, and JSON only where it copies it into the
receipt whole (the zero pages' report).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, JsonValue, field_validator

from sparkrun_coldsnap.digests import require_digest
from sparkrun_coldsnap.documents.capsule_config import CapsuleConfig, ModelFile, NativePayload
from sparkrun_coldsnap.documents.driver_data import Connection, DriverData
from sparkrun_coldsnap.documents.fingerprint import Fingerprint
from sparkrun_coldsnap.documents.request import CaptureRequest, RestoreRequest
from sparkrun_coldsnap.documents.strict import Sparse, Strict
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.host.file_drift import RecordedFile
from sparkrun_coldsnap.units.step import Answer, Empty, Step

#: a report that goes into the receipt as the host wrote it (JSON all the way down)
Report = dict[str, JsonValue]


# -- the unit's ranks, as the workload manager recorded them on the host ------------------


class RootAnswer(Answer):
    pid: int | None = Field(description="The rank's recorded process, if it still runs.")


class RootStep(Step[RootAnswer]):
    """The root of a rank's tree: the process the manager recorded under *name*."""

    verb: ClassVar[str] = "root"
    name: str


class RecordedRank(Strict):
    name: str
    pid: int


class RecordedAnswer(Answer):
    ranks: tuple[RecordedRank, ...]


class RecordedStep(Step[RecordedAnswer]):
    """The ranks recorded under names matching *pattern* (any run of the same recipe) that run."""

    verb: ClassVar[str] = "recorded"
    pattern: str


class AbortAnswer(Answer):
    aborted: int
    problems: tuple[str, ...]


class AbortConnectionsStep(Step[AbortAnswer]):
    """The TCP connections of the ranks under *pattern* ended at once (host/connections.py)."""

    verb: ClassVar[str] = "abort_connections"
    pattern: str


class AdoptAnswer(Answer):
    pidfile: str


class AdoptStep(Step[AdoptAnswer]):
    """A restored tree's root recorded as rank *name*: the manager's status and stop see it."""

    verb: ClassVar[str] = "adopt"
    name: str
    pid: int


# -- capture ----------------------------------------------------------------------------------


class CaptureFactsAnswer(Answer):
    supported: bool
    reason: str
    fingerprint: Fingerprint
    missing_tools: tuple[str, ...] = Field((), description="Commands a capture across hosts runs on this host that it lacks (iptables: CRIU's network lock).")


class CaptureFactsStep(Step[CaptureFactsAnswer]):
    """Whether the request's driver can capture on this host, and this host's fingerprint."""

    verb: ClassVar[str] = "capture_facts"
    request: CaptureRequest


class SocketInterfaceAnswer(Answer):
    interface: str | None = Field(description="The interface holding the address; None: no interface of the host holds it.")


class SocketInterfaceStep(Step[SocketInterfaceAnswer]):
    """The interface of the host holding *address*, the one sparkrun placed its rank at
    (host/socket_iface.py): the one the ranks' collectives bind to."""

    verb: ClassVar[str] = "socket_interface"
    address: str


class FilesAnswer(Answer):
    files: tuple[RecordedFile, ...]


class FilesStep(Step[FilesAnswer]):
    """The regular files the tree at *root_pid* maps or holds open (rank *name*'s log left out)."""

    verb: ClassVar[str] = "files"
    root_pid: int
    name: str | None = None
    skip: tuple[str, ...] = ()


class DumpAnswer(Answer):
    image: UnitImage


class DumpStep(Step[DumpAnswer]):
    """The driver's dump of the stopped tree at the cut, its connections to other hosts included."""

    verb: ClassVar[str] = "dump"
    root_pid: int
    images: str
    unit: str
    host: str
    driver: str
    leave_running: bool = False


class PackedLayerOnHost(Strict):
    """One layer a host packed, at its path there."""

    path: str
    digest: str
    size: int
    media_type: str
    annotations: dict[str, str]


class PackAnswer(Answer):
    image_bytes: int
    zero_pages: Report | None = Field(description="What leaving the zero pages out did, for the receipt (None: not asked, or nothing to do).")
    layers: tuple[PackedLayerOnHost, ...]


class PackStep(Step[PackAnswer]):
    """The unit's images made smaller (zero pages left out) and packed into layers under *out*."""

    verb: ClassVar[str] = "pack"
    images: str
    unit: str
    out: str
    driver: str
    zero_pages: bool = True


# -- devices (drivers with ``device_state``) ---------------------------------------------------


class DevicesLockAnswer(Answer):
    data: DriverData


class DevicesLockStep(Step[DevicesLockAnswer]):
    verb: ClassVar[str] = "devices_lock"
    driver: str
    root_pid: int


class DevicesCheckpointStep(Step[Empty]):
    verb: ClassVar[str] = "devices_checkpoint"
    driver: str
    data: DriverData


class ProblemsAnswer(Answer):
    problems: tuple[str, ...]


class DevicesResumeStep(Step[ProblemsAnswer]):
    """After a failed cut: the unit's device users back to running from *state*."""

    verb: ClassVar[str] = "devices_resume"
    driver: str
    data: DriverData
    state: str


class DevicesRestoreStep(Step[Empty]):
    verb: ClassVar[str] = "devices_restore"
    driver: str
    data: DriverData
    visible: str | None = None


class DevicesUnlockStep(Step[Empty]):
    verb: ClassVar[str] = "devices_unlock"
    driver: str
    data: DriverData


# -- restore ------------------------------------------------------------------------------------


class WeightsFound(Strict):
    """The weight path this host's admission found for its unit."""

    path: str
    native_dir: str | None = None
    note: str | None = None


class ToolsReady(Sparse):
    """What made the restore's tools ready on the host (CRIU's record of the kernel's features)."""

    record: str | None = Field(None, description="The record: made, kept, or kept by CRIU (a tmpfs /run).")
    seconds: float | None = Field(None, description="How long making it took.")
    skipped: str | None = Field(None, description="Why nothing was done.")


class AdmitAnswer(Answer):
    problems: tuple[str, ...]
    restore_tools: ToolsReady | None = Field(None, description="What made the restore's tools ready (when admitted).")
    weights: WeightsFound | None = None


class AdmitStep(Step[AdmitAnswer]):
    """Admission of unit *unit* of the capsule on this host, with this host's own fingerprint;
    the ranks under *pattern* are the workload the restore replaces."""

    verb: ClassVar[str] = "admit"
    config: CapsuleConfig
    request: RestoreRequest
    unit: str
    pattern: str


class InboxAnswer(Answer):
    path: str
    blobs: str


class InboxStep(Step[InboxAnswer]):
    """A private directory on the host, laid out as a store (layers are sent to its blobs)."""

    verb: ClassVar[str] = "inbox"


class LayerRef(Strict):
    """An OCI descriptor of one layer, as the capsule's manifest lists it."""

    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] = {}

    @field_validator("digest")
    @classmethod
    def _digest(cls, value: str) -> str:
        # It names the blob's file in the host's inbox: nothing but a digest may.
        return require_digest(value, "layer digest")


class StageAnswer(Answer):
    staging: str
    images: str
    bytes: int


class StageStep(Step[StageAnswer]):
    """The layers sent to *inbox* verified and unpacked (the inbox removed afterwards)."""

    verb: ClassVar[str] = "stage"
    inbox: str
    layers: tuple[LayerRef, ...]
    unit: str
    unpacked_bytes: int = 0


class PageFillDone(Strict):
    """The memory fill after CRIU's restore (criu/page_fill.py)."""

    bytes: int
    processes: int
    threads: int
    seconds: float
    gb_per_s: float


class TilesGivenBack(Strict):
    """The restored processes given back their AMX tile permission (host/xstate_perm.py)."""

    processes: int
    refused: int


class RestoreMeasured(Sparse):
    """What a host measured of its unit's restore, for the receipt."""

    criu_restore_seconds: float | None = None
    criu_restore_major_faults: int | None = Field(None, description="Pages CRIU waited for from the disk.")
    page_fill: PageFillDone | None = None
    amx_permission: TilesGivenBack | None = None


class RestoreAnswer(Answer):
    pid: int
    details: RestoreMeasured = RestoreMeasured()


class RestoreStep(Step[RestoreAnswer]):
    """The unit's tree back from *images*, stopped at the cut, writing rank *name*'s log."""

    verb: ClassVar[str] = "restore"
    image: UnitImage
    images: str
    name: str
    zombie_wait: float = 30.0


class NetworkLockStep(Step[Empty]):
    """The packets of the unit's connections to other hosts held back (host/peer_lock.py)."""

    verb: ClassVar[str] = "network_lock"
    connections: tuple[Connection, ...]


class NetworkUnlockStep(Step[ProblemsAnswer]):
    verb: ClassVar[str] = "network_unlock"
    connections: tuple[Connection, ...]


# -- the native weight payload ---------------------------------------------------------------------


class PathAnswer(Answer):
    path: str


class NativeStagingStep(Step[PathAnswer]):
    """The directory the host's ranks write their native payload into."""

    verb: ClassVar[str] = "native_staging"
    token: str


class NativePartAnswer(Answer):
    files: tuple[ModelFile, ...]


class NativePartStep(Step[NativePartAnswer]):
    verb: ClassVar[str] = "native_part"
    path: str


class NativePlaceAnswer(Answer):
    directory: str


class NativePlaceStep(Step[NativePlaceAnswer]):
    """This host's part moved under the whole payload's digest."""

    verb: ClassVar[str] = "native_place"
    path: str
    record: NativePayload
    names: tuple[str, ...]


# -- the host ---------------------------------------------------------------------------------------


class IoUringOffAnswer(Answer):
    previous: str | None


class IoUringOffStep(Step[IoUringOffAnswer]):
    """io_uring off for the capture known by *token*, until ``io_uring_back``."""

    verb: ClassVar[str] = "io_uring_off"
    token: str
    coordinator: dict[str, str | int] | None = None


class IoUringBackAnswer(Answer):
    restored: str | None


class IoUringBackStep(Step[IoUringBackAnswer]):
    verb: ClassVar[str] = "io_uring_back"
    token: str


class DropPageCacheStep(Step[Empty]):
    """The host's page cache dropped (before a benchmark's sample)."""

    verb: ClassVar[str] = "drop_page_cache"


class RemoveStep(Step[Empty]):
    """Directories this plugin staged on the host, removed."""

    verb: ClassVar[str] = "remove"
    paths: tuple[str, ...]


STEPS: dict[str, type[Step[Any]]] = {
    s.verb: s
    for s in (
        RootStep, RecordedStep, AbortConnectionsStep, AdoptStep, CaptureFactsStep, SocketInterfaceStep, FilesStep, DumpStep, PackStep,
        DevicesLockStep, DevicesCheckpointStep, DevicesResumeStep, DevicesRestoreStep, DevicesUnlockStep,
        AdmitStep, InboxStep, StageStep, RestoreStep, NetworkLockStep, NetworkUnlockStep,
        NativeStagingStep, NativePartStep, NativePlaceStep, IoUringOffStep, IoUringBackStep, DropPageCacheStep, RemoveStep,
    )
}  # fmt: skip
