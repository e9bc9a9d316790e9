"""``sparkrun run`` of a recipe with a ``coldsnap:`` block: restore, or start vanilla.

sparkrun runs the strategy's preparation steps before its own asset pipeline (its model
check and download), calls ``prepare_activation`` before it stops the old workload and
``activate`` after. A capsule missing here is pulled from ``capsule.repository`` in a
preparation step, with the model files it was published with when this host lacks them,
so sparkrun's model check finds them; admission and staging happen in
``prepare_activation``, so a refusal leaves the old workload serving.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sparkrun_coldsnap import api
from sparkrun_coldsnap.capsule.capsule import open_capsule
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import Receipt, ReceiptBuilder, save_failure_receipt, save_receipt
from sparkrun_coldsnap.documents.recipe_block import ColdsnapBlock
from sparkrun_coldsnap.documents.request import CapsuleRef, RestoreRequest
from sparkrun_coldsnap.errors import ColdsnapError, CompatibilityError, NotFoundError, RestoreError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.interrupts import Interrupts
from sparkrun_coldsnap.integration.placement import (
    OPT_PLAN_INTO,
    OPT_RECEIPT,
    RecipeRun,
    capsule_name_of,
    model_dir_of,
    recipe_run,
    restore_request,
    store_for_run,
    workload_name,
)
from sparkrun_coldsnap.integration.recipe_item import block_of, source_of
from sparkrun_coldsnap.integration.records import local_record_paths, register_local
from sparkrun_coldsnap.lifecycle import run_hooks
from sparkrun_coldsnap.progress import Progress

STRATEGY = "coldsnap"


@dataclasses.dataclass
class DryRun:
    text: str


def _say(text: str) -> None:
    print("[coldsnap] " + text, file=sys.stderr, flush=True)


def _say_in_handler(text: str) -> None:
    # From a signal handler: straight to the descriptor, never into a buffered write the
    # interrupted code may be inside of.
    os.write(2, ("[coldsnap] %s\n" % text).encode(errors="replace"))


#: SIGINT and SIGTERM from preparation to the end of activation (sparkrun runs one at a time)
_INTERRUPTS = Interrupts(_say_in_handler)


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
        """A pull of the recipe's capsule (and the model files it was published with) from
        ``capsule.repository``, before sparkrun checks and downloads the model itself."""
        from sparkrun.plugins import PreparationStep

        opts = context.options
        if opts.dry_run or isinstance((opts.strategy_options or {}).get(OPT_PLAN_INTO), list):
            return ()
        if not block_of(context.plan.recipe).capsule.repository:
            return ()
        return (PreparationStep(name="coldsnap.pull", action=pull_step),)

    def finalize_preparation(self, context: Any, receipts: Mapping[str, Any]) -> Any:
        from sparkrun.plugins import PreparedExecution

        return PreparedExecution(strategy=self.name, assets=asset_policy(), receipts=dict(receipts))

    def prepare_activation(self, context: Any) -> Any:
        opts = context.execution.options
        holder = (opts.strategy_options or {}).get(OPT_PLAN_INTO)
        if isinstance(holder, list):
            holder.append(context)
            return DryRun("planning only")
        # The strategy is an entry: the process's settings (read from the environment once,
        # or installed by our own CLI when it drives sparkrun in-process).
        settings = settings_mod.current()
        run: RecipeRun | None = None
        try:
            run = recipe_run(context)
            store, repository = run.store, run.block.capsule.repository
            if opts.dry_run:
                return DryRun(describe_plan(restore_request(context, run.block), store, repository).text)
            _INTERRUPTS.install()  # until activation ends: SIGTERM unwinds as SIGINT does
            missing, pull_error = _pull_if_missing(context, run)
            req = restore_request(context, run.block)  # after the pull: the model directory may exist now
            multi = len(req.workload.topology.units) > 1

            def when_missing() -> api.Plan:
                fix = "run `sparkrun coldsnap capture %s` first" % source_of(context.execution.plan.recipe)
                return api.when_missing(req, store, settings, asked_by="the recipe sets", fix=fix, repository=repository, pull_error=pull_error)

            # One unit with on_missing: vanilla goes on: a hibernated workload comes back from its own capsule.
            if missing and (pull_error is not None or req.on_missing == "fail"):
                return when_missing()
            try:
                cap = None if missing else open_capsule(store, req.capsule.ref)
            except NotFoundError:
                cap = None
            if cap is None and multi:  # with no capsule the ranks start vanilla
                return when_missing()
            if cap is not None and (multi or len(cap.config.units) > 1):
                # Several units, or a capsule of several: the placement must be the captured one.
                api.refuse_topology(cap, req)
            if multi:
                from sparkrun_coldsnap.integration import unit_operations

                units = unit_operations.prepare(context, req, store=store, progress=Progress())
                _say("capsule %s admitted on %d hosts and staged on each in %.1f s (before the old workload is stopped)" % (
                    req.capsule.ref, len(req.workload.topology.units), units.prepared.prepare_seconds))  # fmt: skip
                return units
            old_root, replacing = _replaced_tree(req)
            req, warm = run_hooks.before_prepare(req, store, settings, _say)  # hibernated or warm: that state comes back
            if warm is not None:
                return api.Plan(req, store, settings, prepared=warm)
            plan = api.prepare(req, store=store, settings=settings, progress=Progress(), replacing=replacing)
            # An interrupt in sparkrun's own steps before activation ends the process there:
            # what was staged goes with it (a no-op once activation took the preparation).
            atexit.register(_drop_at_exit, plan)
            if plan.refused is not None:
                _write_receipt(context, plan.refused, run)
            if plan.prepared is not None:
                _say("capsule %s admitted and staged in %.1f s (before the old workload is stopped)" % (req.capsule.ref, plan.prepared.prepare_seconds))
                if plan.prepared.held_by_replaced:
                    _say("the workload this run replaces (pid %d) holds what the restore needs (%s): it is stopped next, before the restore" % (old_root or 0, "; ".join(plan.prepared.held_by_replaced)))
            return plan
        except ColdsnapError as err:
            _INTERRUPTS.uninstall()  # no activation follows
            if "req" in locals():
                run_hooks.failed(req)
            _write_failure_receipt(context, err, run)
            raise RuntimeError(str(err)) from None
        except KeyboardInterrupt:
            _INTERRUPTS.uninstall()
            _say("interrupted while preparing: nothing was stopped and what was staged is dropped; the workload this run would replace, if any, serves on")
            raise

    def activate(self, context: Any, state: Any) -> Any:
        from sparkrun.plugins import ActivationResult

        from sparkrun_coldsnap.integration.unit_operations import UnitsPlan

        try:
            if isinstance(state, DryRun):
                if state.text != "planning only":
                    _say(state.text)
                return ActivationResult(rc=0, runtime_info={"coldsnap": "dry-run"})
            run = recipe_run(context)
            if isinstance(state, UnitsPlan):
                return self._activate_units(context, state, run)
            plan: api.Plan = state
            atexit.unregister(_drop_at_exit)
            if len(plan.request.workload.topology.units) > 1 and plan.prepared is None:
                return self._start_distributed(context, plan, run)
            return self._activate_here(context, plan, run)
        finally:
            _INTERRUPTS.uninstall()

    def _activate_here(self, context: Any, plan: api.Plan, run: RecipeRun) -> Any:
        """One unit on this host: the workload replaced stopped, the capsule restored (or the
        engine started vanilla), recorded as sparkrun's. From the stop on, a restore is finished
        even when interrupted (interrupts.py); an abandoned one leaves a receipt that says what
        was stopped and what to run."""
        from sparkrun.plugins import ActivationResult

        name = workload_name(context)
        _, log_path = local_record_paths(name)
        local = plan.request.workload.launch.executor == "local"
        recipe_text = _recipe_text(context)
        prepared = plan.prepared
        what = ("restoring %s" % plan.request.capsule.ref) if prepared is not None else "starting the engine"
        stopped: str | None = None
        replaced: tuple[str, int] | None = None
        out: Any = None
        try:
            with _INTERRUPTS.committed(what) if prepared is not None else contextlib.nullcontext():
                ahead = prepared is not None and prepared.restored_ahead
                replaced = _replaced(name) if local and not ahead else None
                if replaced is not None:  # (a tree restored ahead is recorded under the name: it is this workload)
                    stopped = "%s (pid %d)" % replaced
                    _stop_replaced(name, *replaced)
                container = _replaced_container(name) if not local and not ahead else None
                if container is not None:
                    stopped = "container %s (%s)" % (name, container[:12])
                    _stop_replaced_container(name, container)
                try:
                    done = api.activate(plan, log_path=log_path, on_started=(lambda pid: _register(name, pid)) if local else None, progress=Progress(), on_note=_say)
                except ColdsnapError as err:
                    run_hooks.failed(plan.request)
                    if stopped is not None:
                        err.args = ("%s; %s" % (err.message, _nothing_serves(stopped, name, recipe_text)),)
                        if err.receipt is not None:
                            err.receipt = err.receipt.model_copy(update={"details": {**err.receipt.details, "replaced_workload": stopped}})
                    _write_failure_receipt(context, err, run)
                    raise RuntimeError(str(err)) from None
                for receipt in done.receipts:
                    _write_receipt(context, receipt, run)
                out = done.outcome
                if local:
                    register_local(name, out.root_pid)  # containers carry sparkrun's name and labels instead
                written = _write_receipt(context, out.receipt, run)
                opts = context.execution.options
                recipe = opts.recipe if isinstance(opts.recipe, str) else source_of(opts.recipe)
                run_hooks.activated(
                    plan.request, out.receipt, out.root_pid, recipe=str(Path(recipe).resolve()) if Path(recipe).is_file() else recipe, hosts=opts.hosts,
                    cluster=opts.cluster if isinstance(opts.cluster, str | None) else getattr(opts.cluster, "name", None), overrides=dict(opts.overrides or {}),
                    store=plan.store, receipt_path=written,
                )  # fmt: skip
        except KeyboardInterrupt as interrupt:
            if out is not None:  # it came once the workload was up: it serves
                _say("%s came after the restore finished: %s serves (pid %d); `sparkrun stop %s` stops it" % (str(interrupt) or "SIGINT", name, out.root_pid, recipe_text))
                raise
            if replaced is not None:
                # Abandoned while the replaced workload was being stopped: it is stopped, as said.
                from sparkrun_coldsnap.host.process_tree import kill_tree

                kill_tree(replaced[1], grace=10.0)
            _abandoned(context, run, plan, prepared, stopped, name, recipe_text, interrupt)
            raise
        if _INTERRUPTS.pending is not None:
            _say("%s came during the restore, which was finished: %s serves from capsule %s (pid %d); `sparkrun stop %s` stops it" % (
                signal.Signals(_INTERRUPTS.pending).name, name, plan.request.capsule.ref, out.root_pid, recipe_text))  # fmt: skip
            raise KeyboardInterrupt(signal.Signals(_INTERRUPTS.pending).name)
        ttft = "%.2f" % (out.ttft_seconds or 0)
        if done.how == "vanilla":
            _say("vanilla start answered after %.1f s" % (out.ttft_seconds or 0))
            return ActivationResult(rc=0, runtime_info={"coldsnap": "vanilla start (no capsule)", "coldsnap_ttft_s": ttft})
        digest = (out.receipt.capsule or "")[:19]
        _say("restored %s (%s): first token %.2f s after the restore began, reply matches capture" % (plan.request.capsule.ref, digest, out.ttft_seconds or 0))
        if not local:
            # sparkrun then measures a container on its own clock; two numbers, so say whose is whose.
            _say(
                "that time counts from the start of the restore (staging excluded, CRIU included); sparkrun's "
                "'container-start' figures below count from the moment docker reports the restored container started, "
                "and its TTFT is a request of its own sent after this validation"
            )
        return ActivationResult(rc=0, runtime_info={"coldsnap": "restored %s" % digest, "coldsnap_ttft_s": ttft})

    def _activate_units(self, context: Any, plan: Any, run: RecipeRun) -> Any:
        """Every unit restored on its host, validated through rank 0, recorded as sparkrun's ranks."""
        from sparkrun.plugins import ActivationResult

        req = plan.prepared.request
        try:
            out = plan.activate(progress=Progress())
        except ColdsnapError as err:
            _write_failure_receipt(context, err, run)
            raise RuntimeError(str(err)) from None
        _write_receipt(context, out.receipt, run)
        units = req.workload.topology.units
        digest = (out.receipt.capsule or "")[:19]
        _say("restored %s (%s): distributed state restored %d/%d on %s; first token through rank 0 %.2f s after the restore began, reply matches capture" % (
            req.capsule.ref, digest, len(units), len(units), ", ".join(u.host for u in sorted(units, key=lambda u: u.rank)), out.ttft_seconds or 0))  # fmt: skip
        return ActivationResult(rc=0, runtime_info={"coldsnap": "restored %s on %d hosts" % (digest, len(units)), "coldsnap_ttft_s": "%.2f" % (out.ttft_seconds or 0)})

    def _start_distributed(self, context: Any, plan: api.Plan, run: RecipeRun) -> Any:
        """Every rank started on its host by the plugin (sparkrun's own native launch cannot run
        local-executor ranks: ``integration/distributed_start.py`` says why)."""
        from sparkrun.plugins import ActivationResult

        from sparkrun_coldsnap.integration.distributed_start import start_distributed

        units = plan.request.workload.topology.units
        _say("%s: starting %d ranks vanilla on %s (capture them with `sparkrun coldsnap capture`)" % (plan.vanilla_because, len(units), ", ".join(u.host for u in units)))
        try:
            done = start_distributed(context, plan.request, progress=Progress(), because=plan.vanilla_because)
        except ColdsnapError as err:
            _write_failure_receipt(context, err, run)
            raise RuntimeError(str(err)) from None
        _write_receipt(context, done.receipt, run)
        _say("vanilla start of %d ranks answered through rank 0 after %.1f s" % (len(done.ranks), done.ttft_seconds or 0))
        return ActivationResult(rc=0, runtime_info={"coldsnap": "vanilla start of %d ranks (no capsule)" % len(done.ranks), "coldsnap_ttft_s": "%.2f" % (done.ttft_seconds or 0)})


def _replaced_tree(req: RestoreRequest) -> tuple[int | None, frozenset[int]]:
    """The root and processes of the host-process workload this run replaces (sparkrun stops it
    after preparation): what they hold does not refuse the capsule."""
    from sparkrun_coldsnap.host.process_tree import tree_pids
    from sparkrun_coldsnap.integration.records import registered_pid, replaced_workload

    if req.workload.launch.executor != "local":
        return None, frozenset()
    old = replaced_workload(req.workload_name)
    pid = registered_pid(old) if old else None
    return (pid, frozenset(tree_pids(pid))) if pid else (None, frozenset())


def _replaced(name: str) -> tuple[str, int] | None:
    """The host-process workload this run replaces, by its record name and root PID, if any."""
    from sparkrun_coldsnap.integration.records import registered_pid, replaced_workload

    old = replaced_workload(name)
    pid = registered_pid(old) if old else None
    return (old, pid) if old is not None and pid is not None else None


def _stop_replaced(name: str, old: str, pid: int) -> None:
    """Stop the host-process workload this run replaces (*old*, root *pid*), now that the new
    one is staged.

    sparkrun's eviction leaves a workload that keeps its name (the same recipe run again) to
    its runtime's own launch, which removes it by name first; a strategy replaces that launch,
    so the plugin does it here, after preparation and before the restore or start. Under a
    status-aware scheduler the same recipe gets a new name on every run: the workload of the
    same intent recorded here under its old name is the one replaced, and its record goes.
    """
    from sparkrun_coldsnap.host.process_tree import kill_tree
    from sparkrun_coldsnap.integration.records import unregister_local

    _say("stopping the workload this run replaces (pid %d%s), now that the new one is staged" % (pid, "" if old == name else ", %s" % old))
    kill_tree(pid, grace=10.0)
    if old != name:
        unregister_local(old)


def _replaced_container(name: str) -> str | None:
    """The id of sparkrun's container this run replaces: the one that holds the workload's name
    and sparkrun's owner label (a container of that name that is not sparkrun's is left alone,
    and the restore then refuses to take its name)."""
    from sparkrun.core.application_profile import get_application_profile
    from sparkrun.core.ownership import OWNER_LABEL

    from sparkrun_coldsnap.launch import docker

    held = docker.named_container(name)
    # The label, not the name alone (sparkrun's own guard also owns unlabelled containers of its
    # old naming): a container someone made under that name is not removed.
    return held[0] if held is not None and held[1].get(OWNER_LABEL) == get_application_profile().id else None


def _stop_replaced_container(name: str, container: str) -> None:
    """Remove the container this run replaces, now that the new one is staged: sparkrun's own
    docker launch removes a container of the same name first (``docker rm -f``); a strategy
    replaces that launch, so the plugin does it here, after preparation and before the restore
    or start, which would otherwise find the port (and the name) still held."""
    from sparkrun_coldsnap.launch import docker

    _say("removing the container this run replaces (%s, %s), now that the new one is staged" % (name, container[:12]))
    docker.docker("rm", "-f", container, check=False, timeout=120)


def _drop_at_exit(plan: api.Plan) -> None:
    """The process ends between preparation and activation (an interrupt in sparkrun's own
    steps): nothing was stopped; what was staged goes."""
    if plan.prepared is not None:
        plan.discard()
        _say("ended before activation: nothing was stopped (the workload this run would replace, if any, serves on) and what was staged is dropped")


def _recipe_text(context: Any) -> str:
    opts = context.execution.options
    return opts.recipe if isinstance(opts.recipe, str) else source_of(opts.recipe)


def _nothing_serves(stopped: str, name: str, recipe: str) -> str:
    return "the workload it replaced, %s, was stopped before the restore: nothing serves %s now; `sparkrun run %s` starts it again" % (stopped, name, recipe)


def _abandoned(context: Any, run: RecipeRun, plan: api.Plan, prepared: Any, stopped: str | None, name: str, recipe: str, interrupt: KeyboardInterrupt) -> None:
    """An activation interrupted (before the workload it replaces was stopped, or abandoned by a
    second signal after): one line and a failed receipt that say what was stopped and what to run."""
    how = str(interrupt) or "SIGINT"
    plan.discard()  # what was staged, when the interrupt came before the restore took it
    what = ("the restore of %s" % plan.request.capsule.ref) if prepared is not None else "the vanilla start"
    if stopped is None:
        text = "%s: %s was abandoned, what it had started is stopped and what was staged dropped; no workload was stopped for it: `sparkrun run %s` starts it" % (how, what, recipe)
    else:
        text = "%s: %s was abandoned, what it had started is stopped; %s" % (how, what, _nothing_serves(stopped, name, recipe))
    err = RestoreError(text, code="restore.interrupted")
    rb = prepared.receipt if prepared is not None else ReceiptBuilder("start", request_sha256=plan.request.digest())
    if stopped is not None:
        rb.details["replaced_workload"] = stopped
    err.receipt = rb.finish("failed", err)
    run_hooks.failed(plan.request)
    _say(text)
    _write_failure_receipt(context, err, run)


def _register(name: str, pid: int) -> None:
    register_local(name, pid)


def _pull_if_missing(context: Any, run: RecipeRun) -> tuple[bool, NotFoundError | None]:
    """Whether the run's capsule is missing here after a pull from the recipe's repository (when it
    names one), and why that pull found none."""
    try:
        run.store.resolve(run.capsule.ref)
        return False, None
    except NotFoundError:
        if not run.block.capsule.repository:
            return True, None
    model_dir = model_dir_of(context)
    try:
        fetch_capsule(run.block, run.capsule, run.store, model_dir if model_dir.is_dir() else None)
    except NotFoundError as err:
        return True, err
    return False, None


def pull_step(context: Any, receipts: Mapping[str, Any]) -> dict[str, Any]:
    """sparkrun's preparation step: the capsule, if it is not here, from the recipe's repository.

    A capsule the repository lacks is left to ``prepare_activation``, which plans the vanilla
    start (or the failure) the recipe asks for.
    """
    recipe = context.plan.recipe
    block = block_of(recipe)
    name = capsule_name_of(recipe, block)
    try:
        store = store_for_run(context.options, recipe, block)
        store.resolve(name.ref)
        return {"capsule": name.ref, "pulled": False}
    except NotFoundError:
        pass
    except ColdsnapError as err:
        raise RuntimeError(str(err)) from None
    cache = getattr(context.options, "cache_dir", None) or str(context.sctx.config.hf_cache_dir)
    try:
        fetch_capsule(block, name, store, paths.hf_snapshot_dir(str(recipe.model), str(recipe.model_revision), cache))
    except NotFoundError as err:
        _say("no capsule %s in %s: %s" % (name.ref, block.capsule.repository, err))
        return {"capsule": name.ref, "pulled": False}
    except ColdsnapError as err:
        raise RuntimeError(str(err)) from None
    return {"capsule": name.ref, "pulled": True}


def _complete(model_dir: Path, cap: Any) -> bool:
    return bool(cap.config.weights.files) and all((model_dir / f.name).is_file() for f in cap.config.weights.files)


def pull_capsule(block: ColdsnapBlock, req: RestoreRequest, store: CapsuleStore) -> None:
    """Bring a missing capsule (and, if missing too, its weights) from the recipe's repository, before eviction."""
    model_path = req.workload.model.path
    fetch_capsule(block, req.capsule, store, Path(model_path) if model_path else None)


def fetch_capsule(block: ColdsnapBlock, capsule: CapsuleRef, store: CapsuleStore, model_dir: Path | None) -> None:
    """Pull *capsule* from the recipe's repository into *store*, with its model files into *model_dir*
    when the capsule needs them outside its images or this host lacks them (sparkrun's own model
    check wants them either way), and its native weight payload when the recipe may use it."""
    from sparkrun_coldsnap.capsule import transfer
    from sparkrun_coldsnap.capsule.reference import parse
    from sparkrun_coldsnap.capsule.registry import RegistryClient, Transport

    transport = Transport(plain_http=block.capsule.plain_http, ca_file=block.capsule.ca_file)
    ref = parse(block.capsule.repository or "", default_tag=None)
    ref = ref if (ref.tag or ref.digest) else ref.with_tag(capsule.tag)

    def model_dir_of(cap: Any) -> Path:
        return model_dir if model_dir is not None else paths.hf_snapshot_dir(cap.config.weights.model_id, cap.config.weights.revision)

    def want_weights(cap: Any) -> bool:
        needed = cap.config.weights.location == "external" or not _complete(model_dir_of(cap), cap)
        return needed and block.capsule.pull_weights and bool(transfer.weights_subject(cap))

    # Not published, or not fetched: auto takes the recovery path, native is refused at admission.
    got = transfer.pull_with_companions(
        RegistryClient(ref, transport), ref, store, local_ref=capsule.ref, model_dir_of=model_dir_of, want_weights=want_weights,
        want_native=lambda cap: bool(cap.config.weights.native) and block.capsule.pull_native and block.weights in ("auto", "native"),
        native_optional=True, progress=Progress(), trust=block.capsule.trust,
    )  # fmt: skip
    _say("pulled %s from %s" % (capsule.ref, ref))
    if got.weight_files:
        _say("fetched %d model file(s) from the capsule's weights artifact" % got.weight_files)
    if got.native_files:
        _say("fetched the capsule's native weight payload")
    if got.native_error:
        _say("native weight payload not fetched: %s" % got.native_error)


@dataclasses.dataclass(frozen=True)
class PlanView:
    """What a run would do, in words, and the error it would end with (None: it would serve)."""

    text: str
    error: ColdsnapError | None = None


def describe_plan(req: RestoreRequest, store: CapsuleStore, repository: str | None = None) -> PlanView:
    """What ``sparkrun run`` would do, admission included (it only reads: nothing is pulled)."""
    from sparkrun_coldsnap.capsule.capsule import open_capsule

    error: ColdsnapError | None = None
    w = req.workload
    if req.on_incompatible == "vanilla":
        instead = "start the engine vanilla%s" % (" and capture it again" if req.recapture else "")
    else:
        instead = "fail (on_incompatible: fail)"
    try:
        cap = open_capsule(store, req.capsule.ref)
        problems, choice = api.admission(cap, req)
        if req.trust is not None:  # as the restore's own opening of the capsule checks it
            from sparkrun_coldsnap.capsule import signatures

            untrusted = signatures.refusal_in_store(store, req.capsule.ref, cap.digest, req.trust)
            problems = [untrusted, *problems] if untrusted else problems
        head = "restore capsule %s (%s) from %s" % (req.capsule.ref, cap.digest[:19], store.root)
        if problems:
            what = "refuse capsule %s (%s) at admission: %s; then %s" % (req.capsule.ref, cap.digest[:19], "; ".join(problems), instead)
            if req.on_incompatible == "fail":
                error = CompatibilityError("admission refused for capsule %s: %s" % (req.capsule.ref, "; ".join(problems)))
        else:
            weights = "; weights by the %s path%s" % (choice.path, " (%s)" % choice.note if choice.note else "") if choice is not None else ""
            what = "%s: admission passes%s" % (head, weights)
    except NotFoundError as err:
        if repository:
            what = "pull capsule %s from %s (it is not in %s yet), check it at admission and restore it; if the repository has none, %s" % (
                req.capsule.ref, repository, store.root, "start the engine vanilla" if req.on_missing == "vanilla" else "fail (on_missing: fail)")  # fmt: skip
        elif req.on_missing == "vanilla":
            what = "start the engine vanilla: there is no capsule %s in %s" % (req.capsule.ref, store.root)
        else:
            what = "fail: there is no capsule %s in %s (on_missing: fail)" % (req.capsule.ref, store.root)
            error = err
    except ColdsnapError as err:
        what, error = "fail: %s" % err, err
    return PlanView(
        "dry run: the run would %s. Engine %s, driver %s, port %d, workload %s; nothing was changed." % (what, w.engine, w.driver, w.launch.port, req.workload_name),
        error,
    )


def _receipt_place(context: Any, run: RecipeRun | None) -> tuple[Path | None, Path, str]:
    """Where a receipt of this run goes: the path asked for, else the store's receipts of the capsule."""
    explicit = (context.execution.options.strategy_options or {}).get(OPT_RECEIPT)
    run = run or recipe_run(context)
    return Path(explicit) if explicit else None, run.store.receipts, run.capsule.name


def _write_receipt(context: Any, receipt: Receipt, run: RecipeRun | None) -> Path | None:
    try:
        path = save_receipt(receipt, *_receipt_place(context, run))
    except ColdsnapError as err:
        _say("could not write the receipt: %s" % err)
        return None
    _say("receipt: %s" % path)
    return path


def _write_failure_receipt(context: Any, err: ColdsnapError, run: RecipeRun | None) -> None:
    path = save_failure_receipt(err, *_receipt_place(context, run))
    if path is not None:
        _say("receipt: %s" % path)
