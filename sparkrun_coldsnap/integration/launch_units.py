"""sparkrun's placement of a workload turned into launch units: one per host, in rank order.

A native distributed runtime (``vllm-distributed``: ``cluster_strategy() == "native"``) runs
the serve command on every host it placed, each with its node rank: ``--nnodes N
--node-rank R --master-addr HEAD --master-port P``, workers ``--headless``. sparkrun's own
launch renders each host's command with the runtime's ``generate_node_command`` (head
address = the first placed host, rendezvous port = the run's ``init_port``), as its
``materialize()`` does; the plugin renders them the same way, so a unit's command is the one
sparkrun would have run there. The environment is sparkrun's launch environment, plus what
its communication probe found for that host (``NODE_IP``, socket interfaces), kept per unit
as what it adds to the workload's common environment.

sparkrun internals used here: the runtime's ``generate_node_command`` and
``finalize_host_comm_env``, ``ClusterCommEnv.get_env``, ``RankAssignment`` and the probed
``HostHardware`` of the plan.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any

from sparkrun_coldsnap.documents.request import LaunchUnit
from sparkrun_coldsnap.errors import RequestError


def units_of(actx: Any, common_env: Mapping[str, str]) -> tuple[LaunchUnit, ...]:
    """The launch units of the run sparkrun planned in *actx*.

    *common_env* is the environment every unit shares (the workload's ``launch.env``). The
    communication variables added per host name addresses and interfaces, never paths, so
    the host-process form of the environment needs no rewriting of them.
    """
    plan, opts = actx.execution.plan, actx.execution.options
    hosts = tuple(actx.hosts)
    if len(hosts) == 1:
        # As before units carried commands and devices: a solo unit's are the workload's
        # (launch.command; the driver reads CUDA_VISIBLE_DEVICES), and a capsule's recorded
        # unit stays equal to the one a recipe makes now.
        return (LaunchUnit(name="solo", host=hosts[0], rank=0),)
    devices = {h: devices_on(h, plan.placement, (plan.host_hardware or {}).get(h)) for h in hosts}
    runtime = plan.runtime
    if runtime.cluster_strategy() != "native":
        raise RequestError("runtime %s starts its workers through %s, not one engine per host: a multi-host capsule needs a native distributed runtime (runtime: vllm-distributed)" % (runtime.runtime_name, runtime.cluster_strategy()))
    commands = node_commands(runtime, plan.recipe, dict(opts.overrides or {}), hosts, init_port=int(opts.init_port), placement=plan.placement)
    units = []
    for rank, host in enumerate(hosts):
        env = dict(common_env)
        comm = dict(actx.comm_env.get_env(host)) if actx.comm_env is not None else {}
        if "NODE_IP" not in comm and _is_address(host):
            # sparkrun's detection names a host's address only on hosts with InfiniBand. A rank
            # that advertises none falls back to its default route's address, and a host whose
            # only network is the cluster's has no default route: vLLM's then broadcasts the
            # scheduler's queue at 0.0.0.0 and the worker waits on itself forever. The address
            # sparkrun placed the rank at is one every other rank reaches (the head's is the
            # master address).
            comm["NODE_IP"] = host
        # sparkrun layers the communication environment beneath the launch environment.
        env = {**{str(k): str(v) for k, v in runtime.finalize_host_comm_env(comm).items()}, **env}
        units.append(LaunchUnit(name="rank-%d" % rank, host=host, rank=rank, devices=devices[host], command=commands[rank], env=env_delta(common_env, env)))
    return tuple(units)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def node_commands(runtime: Any, recipe: Any, overrides: dict[str, Any], hosts: Sequence[str], *, init_port: int, placement: Any = None) -> list[str]:
    """Each host's serve command, in rank order, as sparkrun's native cluster launch renders it."""
    return [
        runtime.generate_node_command(
            recipe=recipe,
            overrides=dict(overrides),
            head_ip=hosts[0],
            num_nodes=len(hosts),
            node_rank=rank,
            init_port=init_port,
            hosts=list(hosts),
            placement=placement,
        )  # fmt: skip
        for rank in range(len(hosts))
    ]


def devices_on(host: str, placement: Any, hardware: Any) -> tuple[str, ...]:
    """The accelerator indices placement gave *host* (none for the CPU slot the plugin's probe adds)."""
    if placement is None or hardware is None:
        return ()
    accelerators = list(getattr(hardware, "accelerators", None) or ())
    if accelerators and all(getattr(a, "vendor", "") == "cpu" for a in accelerators):
        return ()
    return tuple(str(placement.local_gpu_for_rank(r)) for r in placement.ranks_on_host(host))


def env_delta(common: Mapping[str, str], full: Mapping[str, str]) -> dict[str, str]:
    """What *full* adds to or changes in *common* (a unit's environment over the workload's).

    A variable *common* has and *full* lacks cannot be expressed as an addition: refused,
    since a unit's environment is always the common one plus its own.
    """
    missing = sorted(set(common) - set(full))
    if missing:
        raise RequestError("a launch unit's environment lacks %s of the workload's common environment" % ", ".join(missing))
    return {str(k): str(v) for k, v in full.items() if common.get(k) != v}
