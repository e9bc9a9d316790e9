"""The fingerprint of a workload on this host, and admission: what refuses a restore here.

Admission runs during preparation, before the old workload is stopped, and names every
problem at once: a recipe changed since capture, a host that differs from the one that
captured, the driver's own host-side problems, weights that are missing or altered.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkrun_coldsnap.compat.fingerprint import compare
from sparkrun_coldsnap.documents.fingerprint import Fingerprint, TopologyFacts
from sparkrun_coldsnap.host import file_drift
from sparkrun_coldsnap.host.facts import host_facts
from sparkrun_coldsnap.weights import model_files, weight_paths

if TYPE_CHECKING:
    from sparkrun_coldsnap.documents.capsule_config import CapsuleConfig
    from sparkrun_coldsnap.documents.request import RestoreRequest, Workload
    from sparkrun_coldsnap.drivers.base import SnapshotDriver
    from sparkrun_coldsnap.engines.base import EngineAdapter
    from sparkrun_coldsnap.launch.engine_env import EngineFacts

# Fields of the workload a capsule is not bound to: where the model files and
# caches sit, what the hosts are called and what the recipe's file is named may
# differ between capture and restore, and the weight path is chosen at each restore.
PLACE_ONLY = {
    ("recipe",),
    ("weights",),
    ("model", "path"),
    ("topology", "hosts"),
    ("launch", "env", "HF_HOME"),
    ("launch", "env", "HF_HUB_CACHE"),
    ("launch", "env", "XDG_CACHE_HOME"),
    ("launch", "volumes"),
}


def fingerprint(
    workload: Workload, adapter: EngineAdapter, driver: SnapshotDriver, facts: EngineFacts | None, *,
    tool_version: str | None, container_runtime: str | None,
) -> Fingerprint:  # fmt: skip
    """What a capsule of *workload* depends on, as this host has it."""
    host = host_facts()
    t = workload.topology
    return Fingerprint(
        cpu_arch=host.cpu_arch,
        cpu_features=host.cpu_features,
        kernel_release=host.kernel_release,
        criu_version=tool_version,
        nvidia_driver=host.gpu.nvidia_driver,
        cuda_version=host.gpu.cuda_version,
        gpus=host.gpu.gpus if not driver.weights_in_image else (),
        engine=workload.engine,
        engine_version=adapter.version(facts.packages) if facts else None,
        python_version=facts.python_version if facts else None,
        torch_version=facts.torch_version if facts else None,
        image_digest=workload.launch.image.split("@", 1)[1] if workload.launch.image else None,
        container_runtime=container_runtime,
        engine_env_digest=facts.digest if facts else None,
        model_revision=workload.model.revision,
        topology=TopologyFacts(hosts=len(t.hosts), units=len(t.units), tensor_parallel=t.tensor_parallel, pipeline_parallel=t.pipeline_parallel),
    )


_PORT_OPTION = re.compile(r"(--port[= ])(\d+)")


def at_port(workload: Workload, port: int) -> Workload:
    """*workload* serving on *port*: its launch port and the command's ``--port`` option."""
    command = _PORT_OPTION.sub(lambda m: m.group(1) + str(port), workload.launch.command)
    return workload.model_copy(update={"launch": workload.launch.model_copy(update={"port": port, "command": command})})


def identity_differences(captured: Workload, requested: Workload, *, port_forwarded: bool = False) -> list[str]:
    """How the recipe's workload now differs from the one the capsule holds.

    With *port_forwarded* (the driver restores host processes into a network namespace of
    their own and forwards the recipe's port to the captured one) the port is place-only.
    """
    if port_forwarded:
        requested = at_port(requested, captured.launch.port)
    a, b = captured.model_dump(mode="json"), requested.redacted().model_dump(mode="json")
    out: list[str] = []

    def walk(x: Any, y: Any, path: tuple[str, ...]) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                walk(x.get(k), y.get(k), path + (k,))
        elif x != y and not any(path[:n] in PLACE_ONLY for n in range(1, len(path) + 1)):
            out.append("%s: captured %r, recipe now %r" % (".".join(path), x, y))

    walk(a, b, ())
    return out


def admission(
    cfg: CapsuleConfig, req: RestoreRequest, here: Fingerprint, driver: SnapshotDriver, adapter: EngineAdapter, *,
    replacing: frozenset[int] = frozenset(),
) -> tuple[list[str], weight_paths.WeightChoice | None]:  # fmt: skip
    """What refuses this restore here (empty: nothing), and how its weights would come back."""
    forwarded = driver.own_namespaces and req.workload.launch.executor == "local"
    problems = ["recipe changed since capture: %s" % d for d in identity_differences(cfg.workload, req.workload, port_forwarded=forwarded)]
    problems += [str(m) for m in compare(cfg.fingerprint, here)]
    for unit in cfg.units:
        problems += driver.admission(unit, replacing=replacing)
        drifted = file_drift.differences(unit.files)
        if drifted:
            problems.append(file_drift.refusal(drifted))
    if cfg.weights.location == "external":
        if not req.workload.model.path:
            problems.append("the model directory of %s is unknown on this host: download revision %s" % (cfg.weights.model_id, cfg.weights.revision))
        else:
            problems += model_files.verify(Path(req.workload.model.path), cfg.weights.files)
    elif req.workload.model.path:
        # The weights travel inside the images, but the capsule stays bound to the snapshot it
        # records: a pinned revision whose files here differ is not the revision it was captured from.
        problems += model_files.verify(Path(req.workload.model.path), cfg.weights.files)
    choice = None
    if cfg.weights.location == "external" and not driver.engine_loads_weights:
        choice = weight_paths.choose(cfg, req.workload.weights, adapter)
        problems += [choice.problem] if choice.problem else []
    return problems, choice
