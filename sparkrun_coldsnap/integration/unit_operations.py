"""Capture and restore of a workload sparkrun placed on several hosts: the API's operations
over several units (``api.capture_units``, ``api.prepare_units``, ``api.activate_units``) run
over the hosts sparkrun placed the launch on, through its session and its executor."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sparkrun_coldsnap import api
from sparkrun_coldsnap.api import CaptureOutcome, PreparedRestore, ServingOutcome
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents.request import CaptureRequest, RestoreRequest
from sparkrun_coldsnap.integration.ranks import Ranks, executor_of
from sparkrun_coldsnap.integration.transport import ClusterHosts, open_for
from sparkrun_coldsnap.integration.unit_hosts import SparkrunUnitHosts
from sparkrun_coldsnap.progress import QUIET, Progress


@contextlib.contextmanager
def unit_hosts(actx: Any) -> Iterator[SparkrunUnitHosts]:
    """The placed hosts of *actx* as the API's unit hosts; the session closed after."""
    with open_for(actx) as hosts:
        yield hosts_of(actx, hosts)


def hosts_of(actx: Any, hosts: ClusterHosts) -> SparkrunUnitHosts:
    return SparkrunUnitHosts(Ranks(hosts, executor_of(actx), actx.cluster_id))


def init_port(actx: Any) -> int:
    return int(actx.execution.options.init_port)


def capture(actx: Any, req: CaptureRequest, *, store: CapsuleStore, progress: Progress = QUIET) -> CaptureOutcome:
    with unit_hosts(actx) as hosts:
        return api.capture_units(req, hosts, store=store, init_port=init_port(actx), progress=progress)


@dataclass
class UnitsPlan:
    """A restore of several units prepared in ``prepare_activation``, activated in ``activate``:
    the session to the hosts stays open between the two."""

    prepared: PreparedRestore
    session: ClusterHosts

    def activate(self, progress: Progress = QUIET) -> ServingOutcome:
        try:
            return api.activate_units(self.prepared, progress=progress)
        finally:
            self.session.close()

    def discard(self) -> None:
        try:
            self.prepared.discard()
        finally:
            self.session.close()


def prepare(actx: Any, req: RestoreRequest, *, store: CapsuleStore, progress: Progress = QUIET) -> UnitsPlan:
    session = open_for(actx)
    try:
        return UnitsPlan(api.prepare_units(req, hosts_of(actx, session), store=store, progress=progress), session)
    except BaseException:
        session.close()
        raise
