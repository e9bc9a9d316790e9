"""A workload's ranks on their hosts, as a capture, a restore and a plain start of several
units each need them: in rank order, rank 0's address, io_uring off on every host, and the
start of every rank (head first, the others once it listens)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Sequence

from sparkrun_coldsnap.controller import socket_ifnames
from sparkrun_coldsnap.controller.common import validate
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder, Validation
from sparkrun_coldsnap.documents.request import CaptureRequest, LaunchUnit, RestoreRequest, Workload
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import ColdsnapError, ValidationError
from sparkrun_coldsnap.host import iouring
from sparkrun_coldsnap.launch.remote import UnitHosts
from sparkrun_coldsnap.progress import Progress
from sparkrun_coldsnap.units.resolved import Resolved
from sparkrun_coldsnap.units.steps import IoUringBackStep, IoUringOffStep


def ordered(w: Workload) -> list[LaunchUnit]:
    return sorted(w.topology.units, key=lambda u: u.rank)


def rank0_endpoint(r: Resolved, w: Workload, hosts: UnitHosts) -> Endpoint:
    head = ordered(w)[0]
    e = r.adapter.endpoint(w.launch.command, w.model.id, w.launch.port)
    return Endpoint(e.base_url.replace("127.0.0.1", hosts.head_address(head), 1), e.served_model)


@contextlib.contextmanager
def io_uring_off(hosts: UnitHosts, units: Sequence[LaunchUnit]) -> Iterator[None]:
    """io_uring off on every unit's host while their engines start and are dumped; each host
    counts this capture as one holder, known by its token, beside any capture of its own."""
    token = uuid.uuid4().hex
    by = iouring.coordinator()  # a host where this process runs ends the hold with it, should it be killed outright
    asked: list[LaunchUnit] = []
    try:
        for u in units:
            asked.append(u)  # before the call: one that took the hold but whose answer was lost is let go too
            hosts.call(u, IoUringOffStep(token=token, coordinator=by), timeout=60)
        yield
    finally:
        for u in reversed(asked):
            with contextlib.suppress(ColdsnapError):
                hosts.call(u, IoUringBackStep(token=token), timeout=60)


Launch = Callable[[LaunchUnit], tuple[str, dict[str, str]]]


def recipe_launch(w: Workload) -> Launch:
    """Each unit's command and environment as the recipe and placement give them."""
    return lambda u: (u.command or w.launch.command, {**w.launch.env, **u.env})


def start_ranks(w: Workload, hosts: UnitHosts, rb: ReceiptBuilder, progress: Progress, *, init_port: int, launch: Launch | None = None) -> float:
    """Every unit started on its host, head first, the others once the head listens on the
    rendezvous port; when the first started. *launch* gives each unit's command and environment
    (default: the recipe's); the collectives are bound to each host's placed interface first,
    where the launch does not name one (a host where none holds it is refused before any starts)."""
    units = ordered(w)
    launches = socket_ifnames.pinned(units, hosts, {u.name: (launch or recipe_launch(w))(u) for u in units}, rb)
    t0 = time.monotonic()
    for u in units:
        if u.rank == 1:
            with rb.phase("rendezvous.wait"):
                progress.step("waiting for the head on %s to open port %d" % (units[0].host, init_port))
                hosts.wait_rendezvous(units[0], init_port)
        progress.step("starting %s on %s" % (u.name, u.host))
        with rb.phase("launch.%s" % u.name):
            hosts.start(u, *launches[u.name])
    return t0


def ready_ranks(r: Resolved, req: CaptureRequest | RestoreRequest, hosts: UnitHosts, rb: ReceiptBuilder, progress: Progress, t0: float) -> Validation:
    """Rank 0 answering and validated (its first token timed from *t0*); a failure names the units that died."""
    w = req.workload
    endpoint = rank0_endpoint(r, w, hosts)
    with rb.phase("ready"), progress.waiting("waiting for rank 0 to answer on %s" % endpoint.base_url):
        try:
            r.adapter.wait_ready(endpoint, alive=hosts.alive, timeout=req.ready_timeout_seconds)
        except ColdsnapError as err:
            dead = hosts.dead_units()
            raise type(err)("%s%s" % (err.message, " (%s)" % "; ".join(dead) if dead else "")) from err
    with rb.phase("validate"):
        validation = validate(r, endpoint, req, t0, req.validation.expected_reply)
    rb.validation = validation
    if not validation.passed:
        raise ValidationError("rank 0 on %s replied %r, the recipe expects %r: fix coldsnap.validation.expected_reply" % (ordered(w)[0].host, validation.reply, validation.expected_reply))
    return validation


def start_units(r: Resolved, req: CaptureRequest | RestoreRequest, hosts: UnitHosts, rb: ReceiptBuilder, progress: Progress, *, init_port: int) -> Validation:
    """Every unit started the ordinary way, ready and validated through rank 0."""
    t0 = start_ranks(req.workload, hosts, rb, progress, init_port=init_port)
    return ready_ranks(r, req, hosts, rb, progress, t0)
