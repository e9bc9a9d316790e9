"""The ranks of a workload sparkrun placed on several hosts, each started, asked and stopped on
its host the way sparkrun's local executor does it (``distributed_start.py`` says why the
plugin starts them itself).

sparkrun internals used here: ``resolve_executor`` as ``api._materialize`` resolves a
strategy's executor, the executor's ``generate_node_script``/``status_cmd``/``stop_cmd``/
``logs_cmd``/``node_container_name`` and ``listen_probe_cmd``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sparkrun_coldsnap.documents.request import LaunchUnit
from sparkrun_coldsnap.errors import ColdsnapError, RestoreError, ToolError
from sparkrun_coldsnap.host import log_cause
from sparkrun_coldsnap.integration.transport import ClusterHosts

RENDEZVOUS_TIMEOUT = 300.0  # the head imports vLLM before it binds the port: tens of seconds here


@dataclass(frozen=True)
class RankRecord:
    """One rank started on its host under sparkrun's local-executor name."""

    unit: LaunchUnit
    name: str


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

    def log_text(self, record: RankRecord, lines: int = 400) -> str:
        """The last *lines* of the rank's log (log_cause reads what it says of a failure)."""
        return self._script(record.unit.host, self.executor.logs_cmd(record.name, tail=lines), timeout=30, check=False).stdout

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
            raise RestoreError("%s (%s) on host %s exited before it opened the rendezvous port %d; its log: %s" % (head.unit.name, head.name, head.unit.host, port, log_cause.summary(ranks.log_text(head))))
        if time.monotonic() - t0 > timeout:
            raise RestoreError("%s on host %s did not open the rendezvous port %d in %.0f s" % (head.unit.name, head.unit.host, port, timeout))
        time.sleep(1.0)
    return time.monotonic() - t0


def dead_ranks(ranks: Ranks) -> list[str]:
    """The ranks that had exited, named with their host and what their log says of why."""
    out = []
    for record in ranks.started:
        try:
            if not ranks.alive(record):
                out.append("%s on host %s exited: %s" % (record.unit.name, record.unit.host, log_cause.summary(ranks.log_text(record))))
        except ColdsnapError as err:
            out.append("%s on host %s: %s" % (record.unit.name, record.unit.host, err))
    return out
