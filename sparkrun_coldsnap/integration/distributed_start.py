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

from dataclasses import dataclass
from typing import Any

from sparkrun_coldsnap.controller.common import Attempt, resolve
from sparkrun_coldsnap.controller.units import start_units
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import Receipt, ReceiptBuilder
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.integration.ranks import RankRecord, Ranks, executor_of
from sparkrun_coldsnap.integration.transport import open_for
from sparkrun_coldsnap.integration.unit_hosts import SparkrunUnitHosts
from sparkrun_coldsnap.progress import QUIET, Progress


@dataclass
class DistributedStart:
    receipt: Receipt
    ranks: tuple[RankRecord, ...]
    ttft_seconds: float | None


def start_distributed(actx: Any, req: RestoreRequest, *, progress: Progress = QUIET, because: str | None = None) -> DistributedStart:
    """Start every unit of *req* on its host (head first), wait for rank 0, validate through it."""
    settings = settings_mod.current()
    rb = ReceiptBuilder("start", request_sha256=req.digest())
    if because:
        rb.details["instead_of_restore"] = because
    r = resolve(req.workload, settings)
    with settings_mod.using(settings), open_for(actx) as hosts:
        ranks = Ranks(hosts, executor_of(actx), actx.cluster_id)
        unit_hosts = SparkrunUnitHosts(ranks)
        with Attempt(rb, stop=unit_hosts.stop_all, told="every rank started has been stopped"):
            validation, _ = start_units(r, req, unit_hosts, rb, progress, init_port=int(actx.execution.options.init_port))
        rb.details["units"] = [{"unit": x.unit.name, "host": x.unit.host, "rank": x.unit.rank, "name": x.name} for x in ranks.started]
        return DistributedStart(rb.finish("succeeded"), tuple(ranks.started), validation.ttft_seconds)
