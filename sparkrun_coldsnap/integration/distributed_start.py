"""A workload sparkrun placed on several hosts, started the ordinary way (no capsule) by the plugin.

Why the plugin starts the ranks and not sparkrun's own native cluster launch: sparkrun 0.4.2's
launch (``runtimes/_cluster_ops.run_native_cluster``) waits for the head's rendezvous port with
``wait_for_port(..., container_name=head)`` but does not pass it the executor, so from its
second probe on it asks ``docker inspect`` whether the head runs. A rank of the local executor
is a process, not a container: two seconds after the head starts, before vLLM has even bound
the port (its log still empty), the check says "not running" and sparkrun tears the launch
down. A recipe with a ``coldsnap:`` block hands its launch to the plugin, which starts each
rank here the way that launch meant to:

- each rank by the local executor's own launch script (``generate_node_script``: the same
  ``setsid``, pid record, owner file and log as sparkrun's), run on its host through
  sparkrun's transport, so ``sparkrun status``/``logs``/``stop`` find every rank;
- the head first, then the workers once the head listens on the rendezvous port, the head's
  liveness asked of the executor (``status_cmd``), as the check should have been;
- rank 0's endpoint answers and a streamed greedy reply validates the whole group; any
  failure stops every rank it started.

sparkrun internals used here: ``resolve_executor`` as ``api._materialize`` resolves a
strategy's executor, the executor's ``generate_node_script``/``status_cmd``/``stop_cmd``/
``node_container_name`` and ``listen_probe_cmd``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sparkrun_coldsnap.controller.common import resolve, validate
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import Receipt, ReceiptBuilder
from sparkrun_coldsnap.documents.request import LaunchUnit, RestoreRequest
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import ColdsnapError, RestoreError, ToolError, ValidationError
from sparkrun_coldsnap.integration.transport import ClusterHosts, open_for
from sparkrun_coldsnap.progress import QUIET, Progress

RENDEZVOUS_TIMEOUT = 300.0  # the head imports vLLM before it binds the port: tens of seconds here


@dataclass(frozen=True)
class RankRecord:
    """One rank started on its host under sparkrun's local-executor name."""

    unit: LaunchUnit
    name: str


@dataclass
class DistributedStart:
    receipt: Receipt
    ranks: tuple[RankRecord, ...]
    ttft_seconds: float | None


def executor_of(actx: Any) -> Any:
    """The executor sparkrun resolves for this launch (the recipe's ``executor_config`` included)."""
    from sparkrun.orchestration.executor import resolve_executor

    plan, opts, sctx = actx.execution.plan, actx.execution.options, actx.execution.sctx
    return resolve_executor(
        recipe=plan.recipe, cluster=plan.cluster, runtime=plan.runtime, config=sctx.config,
        cli_overrides={**opts.executor_overrides(), **(plan.executor_target.overrides if plan.executor_target else {})},
        rootless=False, auto_user=False, host_hardware=(plan.host_hardware or {}).get(actx.hosts[0]), v=getattr(sctx, "variables", None),
    )  # fmt: skip


class Ranks:
    """The ranks of one workload on their hosts: start, ask, stop, through sparkrun's transport."""

    def __init__(self, hosts: ClusterHosts, executor: Any, cluster_id: str) -> None:
        self.hosts = hosts
        self.executor = executor
        self.cluster_id = cluster_id
        self.started: list[RankRecord] = []

    def name_of(self, unit: LaunchUnit) -> str:
        return str(self.executor.node_container_name(self.cluster_id, unit.rank))

    def _script(self, host: str, script: str, *, timeout: float = 60.0, check: bool = True) -> Any:
        return self.hosts.run(host, ["bash", "-s"], input=script.encode(), timeout=timeout, check=check)

    def start(self, unit: LaunchUnit, command: str, env: dict[str, str]) -> RankRecord:
        name = self.name_of(unit)
        script = self.executor.for_host(unit.host).generate_node_script(image="", container_name=name, serve_command=command, label="rank %d" % unit.rank, env=env)
        try:
            self._script(unit.host, script)
        except ToolError as err:
            raise RestoreError("starting %s (%s) on host %s failed: %s" % (unit.name, name, unit.host, err)) from err
        record = RankRecord(unit, name)
        self.started.append(record)
        return record

    def alive(self, record: RankRecord) -> bool:
        """Whether the rank's process group still runs (the local executor's own check)."""
        done = self._script(record.unit.host, self.executor.status_cmd(record.name), timeout=30, check=False)
        if done.returncode not in (0, 1):
            raise ToolError("cannot check %s on host %s: %s" % (record.name, record.unit.host, done.tail() or "exit %d" % done.returncode))
        return done.returncode == 0

    def listening(self, host: str, port: int) -> bool:
        from sparkrun.orchestration.health import listen_probe_cmd

        return self._script(host, listen_probe_cmd(port), timeout=30, check=False).returncode == 0

    def log_tail(self, record: RankRecord, lines: int = 5) -> str:
        done = self._script(record.unit.host, self.executor.logs_cmd(record.name, tail=lines), timeout=30, check=False)
        return " | ".join(line.strip() for line in done.stdout.splitlines() if line.strip())[-600:] or "empty"

    def stop_all(self) -> list[str]:
        """Stop every rank started here; the problems, if any, one per rank."""
        problems = []
        for record in reversed(self.started):
            try:
                done = self._script(record.unit.host, self.executor.stop_cmd(record.name), timeout=60, check=False)
                if done.returncode != 0:
                    problems.append("%s on %s: stop exited %d" % (record.name, record.unit.host, done.returncode))
            except ColdsnapError as err:
                problems.append("%s on %s: %s" % (record.name, record.unit.host, err))
        self.started.clear()
        return problems


def wait_rendezvous(ranks: Ranks, head: RankRecord, port: int, timeout: float = RENDEZVOUS_TIMEOUT) -> float:
    """Wait for the head to listen on the rendezvous port, checking it still runs (seconds waited)."""
    t0 = time.monotonic()
    while not ranks.listening(head.unit.host, port):
        if not ranks.alive(head):
            raise RestoreError("%s (%s) on host %s exited before it opened the rendezvous port %d; its log: %s" % (head.unit.name, head.name, head.unit.host, port, ranks.log_tail(head)))
        if time.monotonic() - t0 > timeout:
            raise RestoreError("%s on host %s did not open the rendezvous port %d in %.0f s" % (head.unit.name, head.unit.host, port, timeout))
        time.sleep(1.0)
    return time.monotonic() - t0


def start_distributed(actx: Any, req: RestoreRequest, *, progress: Progress = QUIET, because: str | None = None) -> DistributedStart:
    """Start every unit of *req* on its host (head first), wait for rank 0, validate through it."""
    settings = settings_mod.current()
    rb = ReceiptBuilder("start", request_sha256=req.digest())
    if because:
        rb.details["instead_of_restore"] = because
    w = req.workload
    units = sorted(w.topology.units, key=lambda u: u.rank)
    r = resolve(w, settings)
    head_unit = units[0]
    endpoint = r.adapter.endpoint(w.launch.command, w.model.id, w.launch.port)
    endpoint = Endpoint(endpoint.base_url.replace("127.0.0.1", head_unit.host, 1), endpoint.served_model)
    init_port = int(actx.execution.options.init_port)
    with settings_mod.using(settings), open_for(actx) as hosts:
        ranks = Ranks(hosts, executor_of(actx), actx.cluster_id)
        try:
            t0 = time.monotonic()
            for unit in units:
                if unit.rank == 1:
                    with rb.phase("rendezvous.wait"):
                        progress.step("waiting for the head on %s to open port %d" % (head_unit.host, init_port))
                        wait_rendezvous(ranks, ranks.started[0], init_port)
                progress.step("starting %s on %s" % (unit.name, unit.host))
                with rb.phase("launch.%s" % unit.name):
                    ranks.start(unit, unit.command or w.launch.command, {**w.launch.env, **unit.env})
            with rb.phase("ready"):
                r.adapter.wait_ready(endpoint, alive=lambda: all(ranks.alive(x) for x in ranks.started), timeout=req.ready_timeout_seconds)
            with rb.phase("validate"):
                validation = validate(r, endpoint, req, t0, req.validation.expected_reply)
            rb.validation = validation
            if not validation.passed:
                raise ValidationError("rank 0 on %s replied %r, the recipe expects %r" % (head_unit.host, validation.reply, validation.expected_reply))
        except BaseException as err:
            dead = _dead_ranks(ranks)
            problems = ranks.stop_all()
            if isinstance(err, ColdsnapError):
                extra = "; ".join(dead)
                err.args = ("%s%s; every rank started has been stopped%s" % (err.message, " (%s)" % extra if extra else "", " (%s)" % "; ".join(problems) if problems else ""),)
                err.receipt = rb.finish("failed", err)
            raise
        rb.details["units"] = [{"unit": x.unit.name, "host": x.unit.host, "rank": x.unit.rank, "name": x.name} for x in ranks.started]
        return DistributedStart(rb.finish("succeeded"), tuple(ranks.started), validation.ttft_seconds)


def _dead_ranks(ranks: Ranks) -> list[str]:
    """The ranks that had exited, named with their host and the end of their log."""
    out = []
    for record in ranks.started:
        try:
            if not ranks.alive(record):
                out.append("%s on host %s exited: %s" % (record.unit.name, record.unit.host, ranks.log_tail(record)))
        except ColdsnapError as err:
            out.append("%s on host %s: %s" % (record.unit.name, record.unit.host, err))
    return out
