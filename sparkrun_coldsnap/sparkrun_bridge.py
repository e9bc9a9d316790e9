"""Everything that touches sparkrun (pinned at 0.4.2), in one module.

Public plugin surface (``sparkrun.plugins``): the recipe item, its execution
strategy, the hardware probe and the CLI registration. Internals, each named
here so an upgrade knows where to look:

* ``sparkrun.core.hardware.AcceleratorSpec`` - the CPU accelerator the probe adds;
* the local executor's records (``LocalExecutor``, ``remote_cache_path``,
  ``get_application_profile``) - a pidfile plus an owner file under
  ``~/.cache/sparkrun/local/pids`` is how ``sparkrun status``/``stop`` find a
  host-process workload, so a restored tree is registered the same way;
* ``compose_launch_env``, ``build_volumes``, ``resolved_model_volume`` and the
  local executor's env rewriting - to give the engine the environment
  sparkrun's own launch would;
* ``plugin_policy``/``installed_plugins`` - for ``doctor``.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from sparkrun_coldsnap import controller, paths, plugins
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.errors import ColdsnapError, NotFoundError, RequestError
from sparkrun_coldsnap.progress import Progress
from sparkrun_coldsnap.receipts import Receipt, receipt_path, write_receipt
from sparkrun_coldsnap.recipe_block import ColdsnapBlock, parse_block
from sparkrun_coldsnap.request import (
    CaptureRequest,
    CapsuleName,
    Launch,
    LaunchUnit,
    ModelRef,
    RestoreRequest,
    Topology,
    ValidationSpec,
    Workload,
    is_immutable_revision,
)

KEY = "coldsnap"
OWNER = "coldsnap"
STRATEGY = "coldsnap"
# Per-run options our own CLI passes through sparkrun's RunOptions.strategy_options.
OPT_PLAN_INTO = "coldsnap.plan_into"  # a list: the strategy appends the ActivationContext and stops
OPT_REQUIRE_CAPSULE = "coldsnap.require_capsule"
OPT_RECEIPT = "coldsnap.receipt"
OPT_STORE = "coldsnap.store"


# -- the recipe item ------------------------------------------------------------------


def _source(recipe: Any) -> str:
    return str(getattr(recipe, "source_path", None) or getattr(recipe, "name", None) or "recipe")


class RecipeItem:
    """Parses the ``coldsnap:`` block strictly; an error blocks the launch."""

    def parse(self, value: Any, recipe: Any) -> ColdsnapBlock:
        block = parse_block(value, source=_source(recipe))
        check_block(block, recipe)
        return block

    def validate(self, value: ColdsnapBlock, recipe: Any) -> list[str]:
        return []

    def export(self, value: ColdsnapBlock, recipe: Any) -> Any:
        return value.model_dump(mode="json", exclude_defaults=True)


def check_block(block: ColdsnapBlock, recipe: Any) -> None:
    """Cross-field checks: names must resolve, the model revision must be immutable."""
    src = _source(recipe)
    reg = plugins.registry()
    if block.driver != "auto":
        try:
            reg.driver(block.driver)
        except RequestError as err:
            raise RequestError("%s: coldsnap.driver: %s" % (src, err)) from None
    try:
        if block.engine:
            reg.engine(block.engine)
        else:
            reg.engine_for_runtime(str(getattr(recipe, "runtime", "") or ""))
    except RequestError as err:
        raise RequestError("%s: coldsnap.engine: %s" % (src, err)) from None
    revision = getattr(recipe, "model_revision", None)
    if not revision or not is_immutable_revision(str(revision)):
        raise RequestError(
            "%s: model_revision %r is not immutable: a capsule is bound to exact weights, pin the commit hash (40 hex digits)" % (src, revision)
        )


# -- requests from sparkrun's placement ------------------------------------------------


def block_of(recipe: Any) -> ColdsnapBlock:
    block = recipe.plugin_item(KEY, None)
    if block is None:
        raise RequestError("%s has no coldsnap: block: add one to capture or restore it" % _source(recipe))
    return block


def _select_driver(block: ColdsnapBlock, engine: str) -> str:
    if block.driver != "auto":
        return block.driver
    from sparkrun_coldsnap.hostinfo import host_facts

    host = host_facts()
    reasons = []
    for d in plugins.registry().drivers_by_preference():
        s = d.support(host)
        if s.ok:
            return d.name
        reasons.append("%s: %s" % (d.name, s.reason))
    raise RequestError("no snapshot driver can run on this host (%s): see `sparkrun coldsnap doctor`" % "; ".join(reasons))


def hf_snapshot_dir(cache_dir: str, model_id: str, revision: str) -> str:
    return posixpath.join(cache_dir, "hub", "models--" + model_id.replace("/", "--"), "snapshots", revision)


def launch_env_of(actx: Any) -> dict[str, str]:
    """The environment sparkrun's own launch would give the engine (host paths for host processes)."""
    from sparkrun.core.launch_env import compose_launch_env
    from sparkrun.orchestration.executors.local import _hostify_env

    plan = actx.execution.plan
    runtime, recipe = plan.runtime, plan.recipe
    env = compose_launch_env(
        runtime_common=runtime.get_common_env(),
        runtime_mode=runtime.get_solo_env(),
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
    plan = actx.execution.plan
    recipe = plan.recipe
    reg = plugins.registry()
    engine = block.engine or reg.engine_for_runtime(plan.runtime.runtime_name).name
    revision = str(recipe.model_revision)
    model_dir = hf_snapshot_dir(actx.effective_cache_dir, recipe.model, revision)
    executor = executor_name(actx)
    hosts = tuple(actx.hosts)
    units = tuple(LaunchUnit(name="solo" if len(hosts) == 1 else "rank-%d" % i, host=h, rank=i) for i, h in enumerate(hosts))
    settings = {**(getattr(recipe, "defaults", None) or {}), **(actx.execution.options.overrides or {})}
    container = executor != "local"
    return Workload(
        recipe=str(getattr(recipe, "name", "") or Path(_source(recipe)).stem),
        engine=engine,
        runtime=plan.runtime.runtime_name,
        model=ModelRef(id=recipe.model, revision=revision, path=model_dir if os.path.isdir(model_dir) else None),
        topology=Topology(
            hosts=hosts,
            tensor_parallel=int(settings.get("tensor_parallel") or 1),
            pipeline_parallel=int(settings.get("pipeline_parallel") or 1),
            units=units,
        ),
        launch=Launch(
            executor="local" if executor == "local" else "docker",
            command=actx.serve_command,
            env=launch_env_of(actx),
            port=int(actx.serve_port),
            engine_env=None if container else block.engine_env,
            image=pinned_image(actx.container_image) if container else None,
            volumes=container_volumes(actx) if container else {},
            shm_size=str(_executor_setting(actx, "shm_size") or "32g") if container else None,
        ),
        driver=_select_driver(block, engine),
        weights=block.weights,
    )


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


def _executor_setting(actx: Any, key: str) -> Any:
    recipe = actx.execution.plan.recipe
    cfg = {**(getattr(recipe, "executor_config", None) or {}), **(actx.execution.options.executor_config or {})}
    return cfg.get(key)


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


def capsule_name(actx: Any, block: ColdsnapBlock) -> CapsuleName:
    recipe = actx.execution.plan.recipe
    name = block.capsule.name or re.sub(r"[^a-z0-9]+", "-", Path(_source(recipe)).stem.lower()).strip("-") or "capsule"
    return CapsuleName(name=name, tag=block.capsule.tag)


def validation_of(block: ColdsnapBlock) -> ValidationSpec:
    v = block.validation
    return ValidationSpec(prompt=v.prompt, expected_reply=v.expected_reply, max_tokens=v.max_tokens, timeout_seconds=v.timeout_seconds)


def store_of(block: ColdsnapBlock, override: str | None = None) -> CapsuleStore:
    chosen = override or block.capsule.store
    return CapsuleStore(Path(chosen).expanduser() if chosen else paths.default_store())


def store_for(context: Any) -> CapsuleStore:
    opts = context.execution.options.strategy_options or {}
    return store_of(block_of(context.execution.plan.recipe), opts.get(OPT_STORE))


def capture_request(actx: Any) -> CaptureRequest:
    block = block_of(actx.execution.plan.recipe)
    return CaptureRequest(
        workload=workload_of(actx, block),
        validation=validation_of(block),
        capsule=capsule_name(actx, block),
        ready_timeout_seconds=block.ready_timeout_seconds,
    )


def restore_request(actx: Any) -> RestoreRequest:
    block = block_of(actx.execution.plan.recipe)
    opts = actx.execution.options.strategy_options or {}
    return RestoreRequest(
        workload=workload_of(actx, block),
        validation=validation_of(block),
        capsule=capsule_name(actx, block),
        on_missing="fail" if opts.get(OPT_REQUIRE_CAPSULE) else block.on_missing,
        workload_name=workload_name(actx),
        workload_labels=workload_labels(actx),
        ready_timeout_seconds=block.ready_timeout_seconds,
    )


# -- registering workloads the way sparkrun's local executor records its own ----------------


def workload_name(actx: Any) -> str:
    from sparkrun.orchestration.executors._base import Executor

    return Executor.container_name(actx.cluster_id, "solo")


def _expand_home(path: str) -> Path:
    return Path(path.replace("$HOME", os.path.expanduser("~"), 1))


def local_record_paths(name: str) -> tuple[Path, Path]:
    """(pidfile, logfile) sparkrun's local executor uses for workload *name*."""
    from sparkrun.orchestration.executors.local import default_log_dir, default_pid_dir

    return _expand_home(default_pid_dir()) / (name + ".pid"), _expand_home(default_log_dir()) / (name + ".log")


def register_local(name: str, pid: int) -> Path:
    """Record *pid* (a process-group leader) as workload *name*: status/stop/logs then see it."""
    from sparkrun.core.application_profile import get_application_profile

    from sparkrun_coldsnap.atomic import write_bytes

    pidfile, _ = local_record_paths(name)
    write_bytes(pidfile.with_name(pidfile.name + ".owner"), get_application_profile().id.encode())
    write_bytes(pidfile, ("%d\n" % pid).encode())
    return pidfile


# -- the execution strategy ------------------------------------------------------------------


@dataclasses.dataclass
class DryRun:
    text: str


@dataclasses.dataclass
class Vanilla:
    request: RestoreRequest
    reason: str


def _say(text: str) -> None:
    print("[coldsnap] " + text, file=sys.stderr, flush=True)


def asset_policy():
    from sparkrun.plugins import LaunchAssetPolicy

    # run_builder: a capsule pins its image by digest; rebuilding would change it.
    # clear_page_cache: sparkrun drops caches before launch; after we stage a
    # capsule that would throw the staged images out again.
    return LaunchAssetPolicy(run_builder=False, clear_page_cache=False, sync_tuning=False)


class Strategy:
    """``sparkrun run`` of a recipe with a ``coldsnap:`` block: restore, or start vanilla."""

    name = STRATEGY

    def preparation_steps(self, context: Any) -> tuple:
        return ()

    def finalize_preparation(self, context: Any, receipts: Mapping[str, Any]) -> Any:
        from sparkrun.plugins import PreparedExecution

        return PreparedExecution(strategy=self.name, assets=asset_policy(), receipts=dict(receipts))

    def prepare_activation(self, context: Any) -> Any:
        opts = context.execution.options
        holder = (opts.strategy_options or {}).get(OPT_PLAN_INTO)
        if isinstance(holder, list):
            holder.append(context)
            return DryRun("planning only")
        try:
            req = restore_request(context)
            store = store_for(context)
            if opts.dry_run:
                return DryRun(describe_plan(req, store))
            block = block_of(context.execution.plan.recipe)
            try:
                store.resolve(req.capsule.ref)
            except NotFoundError:
                if block.capsule.repository:
                    try:
                        pull_capsule(block, req, store)
                    except NotFoundError as err:
                        if req.on_missing == "fail":
                            raise
                        return Vanilla(req, "no capsule %s here nor in %s (%s)" % (req.capsule.ref, block.capsule.repository, err))
                    req = restore_request(context)  # the model directory may exist now
                elif req.on_missing == "fail":
                    raise NotFoundError(
                        "capsule %s is not in %s and the recipe sets on_missing: fail: run `sparkrun coldsnap capture %s` first"
                        % (req.capsule.ref, store.root, _source(context.execution.plan.recipe))
                    ) from None
                else:
                    return Vanilla(req, "no capsule %s in %s yet" % (req.capsule.ref, store.root))
            progress = Progress()
            prepared = controller.prepare_restore(req, store=store, progress=progress)
            _say("capsule %s admitted and staged in %.1f s (before the old workload is stopped)" % (req.capsule.ref, prepared.prepare_seconds))
            return prepared
        except ColdsnapError as err:
            _write_failure_receipt(context, err)
            raise RuntimeError(str(err)) from None

    def activate(self, context: Any, state: Any) -> Any:
        from sparkrun.plugins import ActivationResult

        if isinstance(state, DryRun):
            if state.text != "planning only":
                _say(state.text)
            return ActivationResult(rc=0, runtime_info={"coldsnap": "dry-run"})
        name = workload_name(context)
        _, log_path = local_record_paths(name)
        progress = Progress()
        try:
            if isinstance(state, Vanilla):
                _say("%s: starting the engine vanilla (capture it with `sparkrun coldsnap capture`)" % state.reason)
                local = state.request.workload.launch.executor == "local"
                out = controller.start_vanilla(
                    state.request, base_env=dict(os.environ), log_path=log_path, progress=progress, on_started=(lambda pid: register_local(name, pid)) if local else None
                )
                _write_receipt(context, out.receipt)
                _say("vanilla start answered after %.1f s" % (out.ttft_seconds or 0))
                return ActivationResult(rc=0, runtime_info={"coldsnap": "vanilla start (no capsule)", "coldsnap_ttft_s": "%.2f" % (out.ttft_seconds or 0)})
            out = controller.activate_restore(state, log_path=log_path, progress=progress)
            if state.request.workload.launch.executor == "local":
                register_local(name, out.root_pid)  # containers carry sparkrun's name and labels instead
            _write_receipt(context, out.receipt)
            _say(
                "restored %s (%s): first token %.2f s after restore began, reply matches capture"
                % (state.request.capsule.ref, state.capsule.digest[:19], out.ttft_seconds or 0)
            )
            return ActivationResult(
                rc=0, runtime_info={"coldsnap": "restored %s" % state.capsule.digest[:19], "coldsnap_ttft_s": "%.2f" % (out.ttft_seconds or 0)}
            )
        except ColdsnapError as err:
            _write_failure_receipt(context, err)
            raise RuntimeError(str(err)) from None


def pull_capsule(block: ColdsnapBlock, req: RestoreRequest, store: CapsuleStore) -> None:
    """Bring a missing capsule (and, if missing too, its weights) from the recipe's repository, before eviction."""
    from sparkrun_coldsnap.capsule import transfer
    from sparkrun_coldsnap.capsule.registry import RegistryClient, Transport
    from sparkrun_coldsnap.capsule.reference import parse

    transport = Transport(plain_http=block.capsule.plain_http, ca_file=block.capsule.ca_file)
    ref = parse(block.capsule.repository or "", default_tag=None)
    ref = ref if (ref.tag or ref.digest) else ref.with_tag(req.capsule.tag)
    progress = Progress()
    client = RegistryClient(ref, transport)
    cap = transfer.pull(client, ref, store, local_ref=req.capsule.ref, progress=progress).capsule
    _say("pulled %s from %s" % (req.capsule.ref, ref))
    model_dir = req.workload.model.path or hf_snapshot_dir(str(paths.hf_home()), cap.config.weights.model_id, cap.config.weights.revision)
    if cap.config.weights.location == "external" and block.capsule.pull_weights and transfer.weights_subject(cap):
        fetched = transfer.pull_weights(client, cap, Path(model_dir), progress=progress)
        if fetched:
            _say("fetched %d model file(s) from the capsule's weights artifact" % fetched)
    if cap.config.weights.native and block.capsule.pull_native and block.weights in ("auto", "native"):
        try:
            if transfer.pull_native(client, cap, progress=progress):
                _say("fetched the capsule's native weight payload")
        except ColdsnapError as err:  # not published, or not fetched: auto takes the recovery path, native is refused at admission
            _say("native weight payload not fetched: %s" % err)


def describe_plan(req: RestoreRequest, store: CapsuleStore) -> str:
    """What ``sparkrun run`` would do, admission included (it only reads)."""
    from sparkrun_coldsnap.capsule.capsule import open_capsule

    try:
        cap = open_capsule(store, req.capsule.ref)
        problems, choice = controller.admission(cap, req, controller.resolve(req.workload))
        verdict = "admission would refuse it: %s" % "; ".join(problems) if problems else "admission passes"
        if choice is not None and not problems:
            verdict += "; weights by the %s path%s" % (choice.path, " (%s)" % choice.note if choice.note else "")
        what = "restore capsule %s (%s) from %s; %s" % (req.capsule.ref, cap.digest[:19], store.root, verdict)
    except NotFoundError:
        what = "no capsule %s in %s: %s" % (req.capsule.ref, store.root, "start vanilla" if req.on_missing == "vanilla" else "fail")
    except ColdsnapError as err:
        what = "not restore: %s" % err
    w = req.workload
    return "dry run: would %s; engine %s, driver %s, port %d, workload %s; nothing was changed" % (what, w.engine, w.driver, w.launch.port, req.workload_name)


def _receipt_target(context: Any, receipt: Receipt) -> Path:
    explicit = (context.execution.options.strategy_options or {}).get(OPT_RECEIPT)
    name = capsule_name(context, block_of(context.execution.plan.recipe)).name
    return receipt_path(Path(explicit) if explicit else None, store_for(context).receipts, name, receipt)


def _write_receipt(context: Any, receipt: Receipt) -> None:
    try:
        path = write_receipt(receipt, _receipt_target(context, receipt))
        _say("receipt: %s" % path)
    except ColdsnapError as err:
        _say("could not write the receipt: %s" % err)


def _write_failure_receipt(context: Any, err: ColdsnapError) -> None:
    receipt = getattr(err, "receipt", None)
    if receipt is not None:
        _write_receipt(context, receipt)


# -- hardware probe: placement on hosts without a GPU -----------------------------------------------

PROBE_SCRIPT = r"""
echo "COLDSNAP_CPUS=$(nproc 2>/dev/null || echo 1)"
echo "COLDSNAP_MEM_KIB=$(awk '/^MemTotal:/ {print $2; exit}' /proc/meminfo 2>/dev/null)"
"""


def add_cpu_accelerator(parsed: Mapping[str, str], hardware: Any) -> Any:
    """Give a host with no accelerator one ``cpu`` slot, so CPU engines can be placed."""
    if hardware.accelerators or "COLDSNAP_CPUS" not in parsed:
        return hardware
    from sparkrun.core.hardware import AcceleratorSpec

    kib = parsed.get("COLDSNAP_MEM_KIB") or ""
    cpu = AcceleratorSpec(
        vendor="cpu", model="cpu", count=1, memory_gb=round(int(kib) / 1024 / 1024, 1) if kib.isdigit() else None, capabilities=frozenset({"cpu"})
    )
    return dataclasses.replace(hardware, accelerators=[*hardware.accelerators, cpu])


# -- registration with sparkrun ---------------------------------------------------------------------


def _cli_loader():
    from sparkrun_coldsnap.cli import coldsnap_group

    return coldsnap_group


def register_with_sparkrun(v: Any) -> None:
    from sparkrun.plugins import register_cli_command, register_hardware_probe, register_recipe_item

    register_recipe_item(KEY, RecipeItem(), owner=OWNER, execution_strategy=Strategy())
    register_hardware_probe(OWNER, script=PROBE_SCRIPT, enrich=add_cpu_accelerator)
    register_cli_command(_cli_loader, name=KEY)


# -- planning for our own CLI ------------------------------------------------------------------------


def plan_activation(recipe: str, *, hosts: tuple[str, ...] | None, cluster: str | None, overrides: Mapping[str, Any], offline: bool | None) -> Any:
    """sparkrun's placement and rendering for *recipe*, without launching anything.

    A real (probed) plan, then a dry run of the launcher whose strategy call
    hands back the ActivationContext: the serve command, port, hosts and
    cluster id exactly as ``sparkrun run`` would use them.
    """
    from sparkrun import api

    holder: list = []
    opts = api.RunOptions(recipe, hosts=hosts, cluster=cluster, overrides=dict(overrides), offline=offline, strategy_options={OPT_PLAN_INTO: holder})
    plan = api.plan(opts)
    if plan.runtime is None:
        raise RequestError("%s: sparkrun could not resolve a runtime for this recipe" % recipe)
    api.run(dataclasses.replace(opts, dry_run=True), plan=plan)
    if not holder:
        raise RequestError("%s has no coldsnap: block, or the coldsnap plugin is not enabled (sparkrun plugins enable coldsnap)" % recipe)
    return holder[0]


def run_recipe(
    recipe: str, *, hosts: tuple[str, ...] | None, cluster: str | None, overrides: Mapping[str, Any], offline: bool | None,
    require_capsule: bool, receipt: str | None, store: str | None, dry_run: bool,
) -> int:  # fmt: skip
    """``sparkrun run`` of *recipe* through the API (eviction and metadata included)."""
    from sparkrun import api

    opts = api.RunOptions(
        recipe, hosts=hosts, cluster=cluster, overrides=dict(overrides), offline=offline, dry_run=dry_run,
        strategy_options={OPT_REQUIRE_CAPSULE: require_capsule, OPT_RECEIPT: receipt, OPT_STORE: store},
    )  # fmt: skip
    result = api.run(opts)
    return int(result.rc)


# -- plugin state for doctor --------------------------------------------------------------------------


def plugin_state() -> dict[str, Any]:
    """Is our sparkrun plugin enabled, and does another distribution claim its name?"""
    out: dict[str, Any] = {"enabled": None, "reason": None, "providers": [], "problem": None}
    try:
        from sparkrun.core.installed_plugins import installed_plugin_inventory
        from sparkrun.core.plugin_policy import PluginSource, plugin_state as sr_state

        st = sr_state(KEY, source=PluginSource.INSTALLED)
        out["enabled"] = bool(getattr(st, "enabled", False))
        out["reason"] = str(getattr(st, "reason", "") or "")
        rows = [r for r in installed_plugin_inventory() if getattr(r, "name", None) == KEY]
        out["providers"] = sorted({str(getattr(r, "distribution", None) or getattr(r, "module", None) or r) for r in rows})
        failures = [str(getattr(r, "failure", "")) for r in rows if getattr(r, "failure", None)]
        if failures:
            out["problem"] = failures[0]
    except Exception as err:  # noqa: BLE001 - doctor reports, it does not crash
        out["problem"] = "cannot read sparkrun's plugin state: %s" % err
    return out
