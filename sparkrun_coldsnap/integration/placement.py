"""sparkrun's recipe and placement turned into the plugin's requests.

sparkrun internals used here: ``compose_launch_env`` and the local executor's env
rewriting (the environment sparkrun's own launch would give the engine),
``build_volumes``/``resolved_model_volume`` (its container mounts),
``resolve_launch_runtime_cache``/``ensure_runtime_cache_on_hosts`` (the persistent
compile cache its docker launches mount), and the docker executor's workload labels
and names.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError as PydanticValidationError

from sparkrun_coldsnap import extensions
from sparkrun_coldsnap.capsule.store import CapsuleStore, choose_store
from sparkrun_coldsnap.documents.recipe_block import ColdsnapBlock
from sparkrun_coldsnap.documents.request import (
    CapsuleRef,
    CaptureRequest,
    Launch,
    ModelRef,
    RestoreRequest,
    Topology,
    ValidationSpec,
    Workload,
)
from sparkrun_coldsnap.documents.strict import one_line
from sparkrun_coldsnap.errors import RequestError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.integration.launch_units import units_of
from sparkrun_coldsnap.integration.recipe_item import block_of, source_of

# Per-run options our own CLI passes through sparkrun's RunOptions.strategy_options.
OPT_PLAN_INTO = "coldsnap.plan_into"  # a list: the strategy appends the ActivationContext and stops
OPT_REQUIRE_CAPSULE = "coldsnap.require_capsule"
OPT_RECEIPT = "coldsnap.receipt"
OPT_STORE = "coldsnap.store"


def _select_driver(block: ColdsnapBlock, engine: str) -> str:
    if block.driver != "auto":
        return block.driver
    from sparkrun_coldsnap.host.facts import host_facts

    host = host_facts()
    reasons = []
    adapter = extensions.registry().engine(engine)
    for d in extensions.registry().drivers_by_preference():
        s = d.support(host)
        problem = d.engine_problem(adapter) if s.ok else s.reason
        if not problem:
            return d.name
        reasons.append("%s: %s" % (d.name, problem))
    raise RequestError("no snapshot driver can run on this host (%s): see `sparkrun coldsnap doctor`" % "; ".join(reasons))


def launch_env_of(actx: Any) -> dict[str, str]:
    """The environment sparkrun's own launch would give the engine (host paths for host processes)."""
    from sparkrun.core.launch_env import compose_launch_env
    from sparkrun.orchestration.executors.local import _hostify_env

    plan = actx.execution.plan
    runtime, recipe = plan.runtime, plan.recipe
    hosts = tuple(actx.hosts)
    env = compose_launch_env(
        runtime_common=runtime.get_common_env(),
        runtime_mode=runtime.get_solo_env() if len(hosts) == 1 else runtime.get_cluster_env(head_ip=hosts[0], num_nodes=len(hosts)),
        recipe={str(k): str(v) for k, v in (getattr(recipe, "env", None) or {}).items()},
        runtime_extra=runtime.get_extra_env(),
    )
    if executor_name(actx) == "local":
        volumes = container_volumes(actx)
        env = _hostify_env(env, volumes) or env
    return {str(k): str(v) for k, v in env.items()}


def executor_name(actx: Any) -> str:
    target = actx.execution.plan.executor_target
    return str(getattr(target, "executor", None) or "docker")


def workload_of(actx: Any, block: ColdsnapBlock) -> Workload:
    """The workload sparkrun placed; a recipe value the request cannot hold is a one-line RequestError."""
    try:
        return _workload_of(actx, block)
    except PydanticValidationError as err:
        raise RequestError(one_line(err, prefix=source_of(actx.execution.plan.recipe)) + "; fix the recipe") from None


def _workload_of(actx: Any, block: ColdsnapBlock) -> Workload:
    plan = actx.execution.plan
    recipe = plan.recipe
    reg = extensions.registry()
    engine = block.engine or reg.engine_for_runtime(plan.runtime.runtime_name).name
    revision = str(recipe.model_revision)
    model_dir = str(model_dir_of(actx))
    executor = executor_name(actx)
    hosts = tuple(actx.hosts)
    settings = {**(getattr(recipe, "defaults", None) or {}), **(actx.execution.options.overrides or {})}
    container = executor != "local"
    cache_volumes, cache_env = runtime_cache_of(actx) if container else ({}, {})
    env = {**launch_env_of(actx), **cache_env}
    return Workload(
        recipe=str(getattr(recipe, "name", "") or Path(source_of(recipe)).stem),
        engine=engine,
        runtime=plan.runtime.runtime_name,
        model=ModelRef(id=recipe.model, revision=revision, path=model_dir if os.path.isdir(model_dir) else None),
        topology=Topology(
            hosts=hosts,
            tensor_parallel=int(settings.get("tensor_parallel") or 1),
            pipeline_parallel=int(settings.get("pipeline_parallel") or 1),
            units=units_of(actx, env),
        ),
        launch=Launch(
            executor="local" if executor == "local" else "docker",
            command=actx.serve_command,
            env=env,
            port=int(actx.serve_port),
            engine_env=None if container else block.engine_env,
            image=pinned_image(actx.container_image) if container else None,
            volumes={**cache_volumes, **container_volumes(actx)} if container else {},
            shm_size=str(_executor_setting(actx, "shm_size") or "32g") if container else None,
        ),
        driver=_select_driver(block, engine),
        weights=block.weights,
    )


def model_dir_of(actx: Any) -> Path:
    """Where the recipe's pinned model snapshot is (or would be) in the cache sparkrun's launch uses."""
    recipe = actx.execution.plan.recipe
    return paths.hf_snapshot_dir(recipe.model, str(recipe.model_revision), actx.effective_cache_dir)


def pinned_image(image: str | None) -> str | None:
    """The recipe's image pinned by digest: as given, or resolved from the image present here."""
    if not image:
        return None
    if "@sha256:" in image:
        return image
    from sparkrun_coldsnap.launch.docker import image_id

    return "%s@%s" % (image, image_id(image))


def container_volumes(actx: Any) -> dict[str, str]:
    """The mounts sparkrun's docker launch gives the engine (the model cache first)."""
    from sparkrun.orchestration.primitives import build_volumes, resolved_model_volume

    runtime, recipe = actx.execution.plan.runtime, actx.execution.plan.recipe
    volumes = build_volumes(actx.effective_cache_dir, extra={**runtime.get_extra_volumes(), **resolved_model_volume(recipe)})
    return {str(k): str(v) for k, v in volumes.items()}


def runtime_cache_of(actx: Any) -> tuple[dict[str, str], dict[str, str]]:
    """The persistent compile cache sparkrun's docker launch mounts at /cache/runtime: (volumes, env).

    sparkrun resolves it in its own launch path, after the point where a strategy takes
    over, so the container the plugin starts asks for it the same way; empty when the
    cache is turned off (recipe, cluster, config, or SPARKRUN_NO_RUNTIME_CACHE).
    """
    from sparkrun.core.launcher import resolve_launch_runtime_cache
    from sparkrun.orchestration.runtime_cache import ensure_runtime_cache_on_hosts

    plan, opts = actx.execution.plan, actx.execution.options
    mounts = resolve_launch_runtime_cache(
        runtime=plan.runtime, recipe=plan.recipe, overrides=dict(opts.overrides or {}), config=actx.execution.sctx.config, cluster=plan.cluster,
        host_list=list(actx.hosts), ssh_kwargs={}, image=actx.container_image,
        cli_override=None if opts.runtime_cache is None else {"enabled": opts.runtime_cache},
    )  # fmt: skip
    if mounts is None:
        return {}, {}
    if not opts.dry_run:
        ensure_runtime_cache_on_hosts(mounts, list(actx.hosts), {})
    return {str(k): str(v) for k, v in mounts.volumes.items()}, {str(k): str(v) for k, v in mounts.env.items()}


def _executor_setting(actx: Any, key: str) -> Any:
    recipe = actx.execution.plan.recipe
    cfg = {**(getattr(recipe, "executor_config", None) or {}), **(actx.execution.options.executor_config or {})}
    return cfg.get(key)


def workload_name(actx: Any) -> str:
    from sparkrun.orchestration.executors._base import Executor

    return Executor.container_name(actx.cluster_id, "solo")


def workload_labels(actx: Any) -> dict[str, str]:
    """The labels sparkrun's docker executor puts on its workloads (status and stop check them)."""
    if executor_name(actx) == "local":
        return {}
    from sparkrun.core.application_profile import get_application_profile
    from sparkrun.core.ownership import OWNER_LABEL
    from sparkrun.orchestration.executors._base import Executor

    plan = actx.execution.plan
    labels = dict(Executor.workload_labels_for_cluster(actx.cluster_id, plan.recipe, plan.runtime, placement=plan.placement, host=actx.hosts[0]) or {})
    labels[OWNER_LABEL] = get_application_profile().id  # the owner guard of status and stop reads this
    return {str(k): str(v) for k, v in labels.items()}


def capsule_name(actx: Any, block: ColdsnapBlock) -> CapsuleRef:
    return capsule_name_of(actx.execution.plan.recipe, block)


def capsule_name_of(recipe: Any, block: ColdsnapBlock) -> CapsuleRef:
    return block.capsule.ref(re.sub(r"[^a-z0-9]+", "-", Path(source_of(recipe)).stem.lower()).strip("-") or "capsule")


def validation_of(block: ColdsnapBlock) -> ValidationSpec:
    v = block.validation
    return ValidationSpec(prompt=v.prompt, expected_reply=v.expected_reply, max_tokens=v.max_tokens, timeout_seconds=v.timeout_seconds, logprob_tolerance=v.logprob_tolerance)


def store_of(block: ColdsnapBlock, override: str | None = None) -> CapsuleStore:
    return choose_store(override, block.capsule.store)


def store_for(context: Any) -> CapsuleStore:
    return store_for_run(context.execution.options, context.execution.plan.recipe)


def store_for_run(options: Any, recipe: Any, block: ColdsnapBlock | None = None) -> CapsuleStore:
    return store_of(block or block_of(recipe), (options.strategy_options or {}).get(OPT_STORE))


@dataclass(frozen=True)
class RecipeRun:
    """What the ``coldsnap:`` block of the recipe a run launches says, read from sparkrun's
    recipe once: the block, the capsule it names, the store that keeps it."""

    block: ColdsnapBlock
    capsule: CapsuleRef
    store: CapsuleStore


def recipe_run(actx: Any) -> RecipeRun:
    recipe = actx.execution.plan.recipe
    block = block_of(recipe)
    return RecipeRun(block, capsule_name_of(recipe, block), store_for_run(actx.execution.options, recipe, block))


def capture_request(actx: Any, block: ColdsnapBlock | None = None) -> CaptureRequest:
    """The capture of what sparkrun placed; *block*: the recipe's ``coldsnap:`` block, when read already."""
    block = block or block_of(actx.execution.plan.recipe)
    return CaptureRequest(
        workload=workload_of(actx, block),
        validation=validation_of(block),
        capsule=capsule_name(actx, block),
        ready_timeout_seconds=block.ready_timeout_seconds,
    )


def restore_request(actx: Any, block: ColdsnapBlock | None = None) -> RestoreRequest:
    """The restore of what sparkrun placed; *block*: the recipe's ``coldsnap:`` block, when read already."""
    block = block or block_of(actx.execution.plan.recipe)
    opts = actx.execution.options.strategy_options or {}
    return RestoreRequest(
        workload=workload_of(actx, block),
        validation=validation_of(block),
        capsule=capsule_name(actx, block),
        on_missing="fail" if opts.get(OPT_REQUIRE_CAPSULE) else block.on_missing,
        on_incompatible="fail" if opts.get(OPT_REQUIRE_CAPSULE) else block.on_incompatible,
        recapture=block.recapture,
        workload_name=workload_name(actx),
        workload_labels=workload_labels(actx),
        ready_timeout_seconds=block.ready_timeout_seconds,
        trust=block.capsule.trust,
    )
