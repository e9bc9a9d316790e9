"""One flat function per operation: capture, prepare/activate a restore, start vanilla.

Each operation runs named, timed phases into a receipt, stages its work
privately and publishes last, and on failure cleans up (stops what it
started, drops what it staged) without hiding the first error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from sparkrun_coldsnap import disk_room, native_payload, page_cache, plugins, weight_paths, weights
from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule import media
from sparkrun_coldsnap.capsule.capsule import Capsule
from sparkrun_coldsnap.capsule.config import CapsuleConfig, CapturedValidation, EngineRecord, NativePayload, WeightsRecord
from sparkrun_coldsnap.capsule.pack import pack_unit, unpack_layer
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.compat import Fingerprint, TopologyFacts, compare
from sparkrun_coldsnap.drivers.base import SnapshotDriver, UnitImage
from sparkrun_coldsnap.drivers.criu_tool import Criu
from sparkrun_coldsnap.drivers.n580 import template_command, wait_for_boundary
from sparkrun_coldsnap.engines.base import EngineAdapter, Endpoint
from sparkrun_coldsnap.errors import CaptureError, ColdsnapError, CompatibilityError, RestoreError, ValidationError, describe_cleanup_failure
from sparkrun_coldsnap.hostinfo import host_facts
from sparkrun_coldsnap.launch.engine_env import EngineEnv, EngineFacts, command_facts
from sparkrun_coldsnap.launch.iouring import io_uring_disabled
from sparkrun_coldsnap.launch import docker as docker_unit
from sparkrun_coldsnap.launch.docker import ContainerSpec
from sparkrun_coldsnap.launch.local import StartedUnit, start_unit, tree_pids
from sparkrun_coldsnap.launch.ports import port_holder
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.receipts import Receipt, ReceiptBuilder, Validation, Weights
from sparkrun_coldsnap.request import CaptureRequest, RestoreRequest, Workload
from sparkrun_coldsnap import paths

# Fields of the workload a capsule is not bound to: where the model files and
# caches sit and what the hosts are called may differ between capture and restore,
# and the weight path is chosen at each restore.
_PLACE_ONLY = {
    ("weights",),
    ("model", "path"),
    ("topology", "hosts"),
    ("launch", "env", "HF_HOME"),
    ("launch", "env", "HF_HUB_CACHE"),
    ("launch", "env", "XDG_CACHE_HOME"),
    ("launch", "volumes"),
}


# -- shared pieces ------------------------------------------------------------


@dataclass(frozen=True)
class Resolved:
    adapter: EngineAdapter
    driver: SnapshotDriver
    engine_env: EngineEnv | None
    facts: EngineFacts | None


def resolve(workload: Workload) -> Resolved:
    reg = plugins.registry()
    adapter = reg.engine(workload.engine)
    driver = reg.driver(workload.driver)
    engine_env = EngineEnv.named(workload.launch.engine_env) if workload.launch.engine_env else None
    if engine_env is not None:
        facts = engine_env.facts()
    elif workload.launch.executor == "local":
        facts = command_facts(workload.launch.command, {"PATH": os.environ.get("PATH", ""), **workload.launch.env})
    else:
        facts = None  # a container: the image digest stands for what is inside
    return Resolved(adapter, driver, engine_env, facts)


def fingerprint(workload: Workload, r: Resolved, criu_version: str | None) -> Fingerprint:
    host = host_facts()
    t = workload.topology
    return Fingerprint(
        cpu_arch=host.cpu_arch,
        cpu_features=host.cpu_features,
        kernel_release=host.kernel_release,
        criu_version=criu_version,
        nvidia_driver=host.gpu.nvidia_driver,
        cuda_version=host.gpu.cuda_version,
        gpus=host.gpu.gpus if not r.driver.weights_in_image else (),
        engine=workload.engine,
        engine_version=r.adapter.version(r.facts.packages) if r.facts else None,
        python_version=r.facts.python_version if r.facts else None,
        torch_version=r.facts.torch_version if r.facts else None,
        image_digest=workload.launch.image.split("@", 1)[1] if workload.launch.image else None,
        container_runtime=docker_unit.runtime_summary() if workload.launch.executor == "docker" else None,
        engine_env_digest=r.facts.digest if r.facts else None,
        model_revision=workload.model.revision,
        topology=TopologyFacts(hosts=len(t.hosts), units=len(t.units), tensor_parallel=t.tensor_parallel, pipeline_parallel=t.pipeline_parallel),
    )


def launch_env(workload: Workload, r: Resolved, base_env: Mapping[str, str]) -> dict[str, str]:
    """The engine's environment: a container gets only the workload's; a host process inherits ours too."""
    if workload.launch.executor == "docker":
        return dict(workload.launch.env)
    env = {**base_env, **workload.launch.env}
    return r.engine_env.apply(env) if r.engine_env else env


def container_spec(workload: Workload, command: str, env: Mapping[str, str], labels: Mapping[str, str] | None = None) -> ContainerSpec:
    if not workload.launch.image:
        raise CaptureError("the recipe runs in a container but names no image pinned by digest: set container:")
    return ContainerSpec(
        image=workload.launch.image.split("@", 1)[1],
        command=command,
        env=dict(env),
        volumes=dict(workload.launch.volumes),
        shm_size=workload.launch.shm_size or "32g",
        labels=dict(labels or {}),
    )


def launch_unit(workload: Workload, command: str, env: Mapping[str, str], log_path: Path, *, name: str, labels: Mapping[str, str] | None = None):
    """Start the engine as host processes or in a container, as the workload's executor says."""
    if workload.launch.executor == "docker":
        return docker_unit.start_container(container_spec(workload, command, env, labels), name)
    return start_unit(command, env=env, log_path=log_path)


def _validate(r: Resolved, endpoint: Endpoint, req: CaptureRequest | RestoreRequest, t0: float, expected: str | None) -> Validation:
    v = req.validation
    reply = r.adapter.validate(endpoint, prompt=v.prompt, max_tokens=v.max_tokens, timeout=v.timeout_seconds)
    ttft = (reply.first_token_at - t0) if reply.first_token_at is not None else None
    passed = expected is None or reply.text == expected
    return Validation(passed=passed, ttft_seconds=ttft, request_ttft_seconds=reply.request_ttft, reply=reply.text, expected_reply=expected)


def _stop_quietly(unit, first: BaseException) -> None:
    if unit is None:
        return
    try:
        unit.stop(grace=5.0)
    except Exception as cleanup:  # noqa: BLE001 - reported beside the first error
        first.args = (describe_cleanup_failure(first, cleanup),)


def finish(rb: ReceiptBuilder, err: BaseException | None) -> Receipt:
    if err is None:
        return rb.finish("succeeded")
    state = "refused" if isinstance(err, CompatibilityError) else "failed"
    return rb.finish(state, err)


# -- capture ---------------------------------------------------------------------


@dataclass
class CaptureOutcome:
    receipt: Receipt
    capsule: Capsule | None = None


def capture(req: CaptureRequest, *, store: CapsuleStore, base_env: Mapping[str, str], progress: Progress = QUIET) -> CaptureOutcome:
    """Launch the engine, validate it, capture it into a capsule in *store*."""
    rb = ReceiptBuilder("capture", request_sha256=req.digest())
    rb.capsule_ref = req.capsule.ref
    w = req.workload
    running = None
    try:
        with rb.phase("admission"):
            r = resolve(w)
            support = r.driver.support(host_facts())
            if not support.ok:
                raise CaptureError("snapshot driver %s cannot capture on this host: %s" % (r.driver.name, support.reason))
            holder = port_holder(w.launch.port)
            if holder:
                raise CaptureError("port %d is in use by %s: stop that workload (sparkrun stop) or capture on another port" % (w.launch.port, holder))
            if len(w.topology.units) != 1:
                raise CaptureError("this capture path handles one launch unit on the local host; the recipe places %d" % len(w.topology.units))
            if w.launch.executor == "docker":
                docker_unit.check_checkpointing()
            store.init()
        with rb.phase("model_digests"):
            model_files = weights.record(Path(w.model.path)) if w.model.path else ()
        native_wanted = weight_paths.writes_native(w, r.driver, r.adapter)
        command, env = r.adapter.prepare_launch(w.launch.command, launch_env(w, r, base_env), release_weights=r.driver.needs_release, native_weights=native_wanted)
        if r.driver.boundary == "template":
            preload = tuple(m for m in os.environ.get("COLDSNAP_TEMPLATE_PRELOAD", "").split(",") if m) or r.adapter.template_preload
            command = template_command(command, module_for_script=r.adapter.console_scripts, preload=preload)
        log_path = paths.run_dir() / "logs" / ("capture-%s-%d.log" % (req.capsule.name, os.getpid()))
        log_path.unlink(missing_ok=True)
        unit_def = w.topology.units[0]
        with contextlib.ExitStack() as stack:
            stack.enter_context(io_uring_disabled())
            staging = stack.enter_context(store.staging_dir("capture-"))
            images = staging / "units" / unit_def.name
            progress.step("starting %s for capture (%s, driver %s)" % (w.engine, req.capsule.ref, r.driver.name))
            with rb.phase("launch"):
                t0 = time.monotonic()
                unit = running = launch_unit(w, command, env, log_path, name="coldsnap-capture-%s" % req.capsule.name)
            endpoint = r.adapter.endpoint(w.launch.command, w.model.id, w.launch.port)
            if r.driver.boundary == "template":
                image, validation = _capture_template(r, req, unit, endpoint, images, log_path, rb, progress, t0)
                unit.stop(grace=10.0)
                native = None
            else:
                image, validation, native = _capture_serving(r, req, unit, endpoint, images, log_path, rb, progress, t0, native_wanted)
                if w.launch.executor == "docker":
                    unit.remove()  # checkpointed and stopped; its layer is in the images now
            running = None
            unit.reap()
            with rb.phase("pack"), progress.transfer("packing %.0f MB of process images" % (image.image_bytes / 1e6), image.image_bytes) as tick:
                layers = pack_unit(images, unit_def.name, staging, tick=tick)
            config = CapsuleConfig(
                name=req.capsule.name,
                tag=req.capsule.tag,
                created=capsule_mod.now_iso(),
                request_sha256=req.digest(),
                workload=w.redacted(),
                fingerprint=fingerprint(w, r, image.criu_version),
                engine=EngineRecord(name=w.engine, version=r.adapter.version(r.facts.packages) if r.facts else None),
                driver=r.driver.name,
                validation=CapturedValidation(
                    prompt=req.validation.prompt, max_tokens=req.validation.max_tokens, reply=validation.reply or "", request_ttft_seconds=validation.request_ttft_seconds
                ),
                weights=WeightsRecord(
                    location="in-image" if r.driver.weights_in_image else "external", model_id=w.model.id, revision=w.model.revision, files=model_files, native=native
                ),
                units=(image,),
            )
            with rb.phase("publish"):
                desc = capsule_mod.publish(store, layers, config)
        rb.capsule = desc.digest
        rb.details["image_bytes"] = image.image_bytes
        rb.details["capsule_bytes"] = sum(l.size for l in layers)
        return CaptureOutcome(finish(rb, None), capsule_mod.open_capsule(store, req.capsule.ref))
    except BaseException as err:
        _stop_quietly(running, err)
        if isinstance(err, ColdsnapError):
            err.receipt = finish(rb, err)  # type: ignore[attr-defined]
        raise


def _ready(r: Resolved, endpoint: Endpoint, unit, log_path: Path, rb: ReceiptBuilder, progress: Progress, timeout: float) -> None:
    try:
        with rb.phase("ready"), progress.waiting("waiting for %s to answer on %s" % (r.adapter.name, endpoint.base_url)) as tick:
            r.adapter.wait_ready(endpoint, alive=unit.alive, timeout=timeout, on_tick=lambda s: tick(s, unit.tail()))
    except ColdsnapError as err:
        where = "container %s, %s" % (unit.name, docker_unit.LOG_IN_CONTAINER) if isinstance(unit, docker_unit.ContainerUnit) else str(log_path)
        raise type(err)("%s; engine log: %s (last line: %s)" % (err, where, unit.tail() or "empty")) from err


def _validated(r: Resolved, endpoint: Endpoint, req: CaptureRequest, rb: ReceiptBuilder, progress: Progress, t0: float) -> Validation:
    with rb.phase("validate"):
        validation = _validate(r, endpoint, req, t0, req.validation.expected_reply)
    rb.validation = validation
    if not validation.passed:
        raise ValidationError("the engine replied %r, the recipe expects %r: fix coldsnap.validation.expected_reply" % (validation.reply, validation.expected_reply))
    progress.note("first token %.1f s after launch; reply %r" % (validation.ttft_seconds or 0, validation.reply))
    rb.details["vanilla_ttft_seconds"] = validation.ttft_seconds
    return validation


def _precheck(r: Resolved, unit, images: Path, rb: ReceiptBuilder) -> None:
    """What the driver cannot capture, and whether the disks have room for what it will write."""
    with rb.phase("precheck"):
        problems = r.driver.precheck(unit.root_pid)
        estimate = disk_room.dump_estimate(tree_pids(unit.root_pid))
        places = [(images, 2.0, "writing the process images and packing them")]
        if isinstance(unit, docker_unit.ContainerUnit):
            places.append((Path(docker_unit.info()["root_dir"]), 1.0, "docker's checkpoint"))
        short = disk_room.shortfall(estimate, places)
    rb.details["dump_estimate_bytes"] = estimate
    if problems:
        raise CaptureError("cannot capture the workload: %s" % "; ".join(problems))
    if short:
        raise CaptureError("%s; free space there, or put the capsule store on a larger disk (coldsnap.capsule.store)" % short)


def _export_native(r: Resolved, req: CaptureRequest, endpoint: Endpoint, rb: ReceiptBuilder, progress: Progress) -> NativePayload | None:
    try:
        with rb.phase("native_export"), progress.waiting("writing the native weight payload"):
            record, reports = native_payload.export(r.adapter, endpoint)
    except ColdsnapError as err:
        if req.workload.weights == "native":
            raise CaptureError("writing the native weight payload failed: %s; capture with weights: auto or recovery" % err) from err
        rb.details["native_export_error"] = str(err)  # auto: restores take the recovery path
        progress.note("no native weight payload (%s): restores will use recovery" % err)
        return None
    rb.details["native_export"] = list(reports)
    return record


def _capture_serving(r, req, unit, endpoint, images, log_path, rb, progress, t0, native_wanted: bool) -> tuple[UnitImage, Validation, NativePayload | None]:
    """Validate the serving engine, write its native weights, release its device memory,
    then checkpoint it (the tree ends)."""
    _ready(r, endpoint, unit, log_path, rb, progress, req.ready_timeout_seconds)
    validation = _validated(r, endpoint, req, rb, progress, t0)
    native = _export_native(r, req, endpoint, rb, progress) if native_wanted else None
    if r.driver.needs_release:
        with rb.phase("release_memory"):
            r.adapter.release_memory(endpoint)
    _precheck(r, unit, images, rb)
    unit_def = req.workload.topology.units[0]
    with rb.phase("checkpoint"), progress.waiting("checkpointing the process tree") as tick:
        if isinstance(unit, docker_unit.ContainerUnit):
            image = r.driver.checkpoint_container(unit, images, unit_name=unit_def.name, host=unit_def.host, spec=unit.spec, progress=lambda m: tick(0, m))
        else:
            image = r.driver.checkpoint(unit.root_pid, images, unit=unit_def.name, host=unit_def.host, progress=lambda m: tick(0, m))
    return image, validation, native


def _capture_template(r, req, unit, endpoint, images, log_path, rb, progress, t0) -> tuple[UnitImage, Validation]:
    """Checkpoint at the pre-CUDA boundary, then let the engine go on to serve once for the recorded reply."""
    with rb.phase("boundary"), progress.waiting("waiting for the engine to reach its pre-CUDA boundary"):
        wait_for_boundary(log_path, unit.alive, req.ready_timeout_seconds)
    _precheck(r, unit, images, rb)
    unit_def = req.workload.topology.units[0]
    with rb.phase("checkpoint"), progress.waiting("checkpointing the template") as tick:
        image = r.driver.checkpoint(unit.root_pid, images, unit=unit_def.name, host=unit_def.host, progress=lambda m: tick(0, m))
    t_resume = time.monotonic()
    r.driver.resume(unit.root_pid)
    _ready(r, endpoint, unit, log_path, rb, progress, req.ready_timeout_seconds)
    validation = _validated(r, endpoint, req, rb, progress, t_resume)
    return image, validation


# -- restore -------------------------------------------------------------------------


def new_restore_staging(store: CapsuleStore, unpacked_bytes: int) -> Path:
    """Memory-backed staging when there is room for it, else the store's own."""
    memory = paths.memory_staging(unpacked_bytes)
    if memory is not None:
        memory.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="restore-", dir=memory))
    return store.new_staging_dir("restore-")


@dataclass
class PreparedRestore:
    """A capsule admitted and unpacked, ready to activate (the old workload still runs)."""

    request: RestoreRequest
    capsule: Capsule
    staging: Path
    resolved: Resolved
    receipt: ReceiptBuilder
    prepare_seconds: float = 0.0
    weights: weight_paths.WeightChoice | None = None
    #: what the driver started ahead of the restore (its warm_up), owned until activation
    warm: Any = None
    #: for container capsules: the new container, created and loaded, not started
    container: docker_unit.ContainerUnit | None = None
    _cleaned: bool = field(default=False, repr=False)

    def handed_over(self) -> None:
        """The driver removes the staging directory itself, once it is done reading it."""
        self._cleaned = True

    def cleanup(self) -> None:
        if self.warm is not None:
            self.warm.close()
            self.warm = None
        if not self._cleaned:
            shutil.rmtree(self.staging, ignore_errors=True)
            self._cleaned = True

    def discard(self) -> None:
        """Drop everything preparation made (an activation that never happens)."""
        if self.container is not None:
            self.container.remove()
            self.container = None
        self.cleanup()


def identity_differences(captured: Workload, requested: Workload) -> list[str]:
    """How the recipe's workload now differs from the one the capsule holds."""
    a, b = captured.model_dump(mode="json"), requested.redacted().model_dump(mode="json")
    out = []

    def walk(x, y, path):
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                walk(x.get(k), y.get(k), path + (k,))
        elif x != y and not any(path[:n] in _PLACE_ONLY for n in range(1, len(path) + 1)):
            out.append("%s: captured %r, recipe now %r" % (".".join(path), x, y))

    walk(a, b, ())
    return out


def admission(capsule: Capsule, req: RestoreRequest, r: Resolved) -> tuple[list[str], weight_paths.WeightChoice | None]:
    """What refuses this restore here (empty: nothing), and how its weights would come back."""
    cfg = capsule.config
    problems = ["recipe changed since capture: %s" % d for d in identity_differences(cfg.workload, req.workload)]
    criu = Criu.locate()
    problems += [str(m) for m in compare(cfg.fingerprint, fingerprint(req.workload, r, criu.version))]
    for unit in cfg.units:
        problems += r.driver.admission(unit)
    if cfg.weights.location == "external":
        if not req.workload.model.path:
            problems.append("the model directory of %s is unknown on this host: download revision %s" % (cfg.weights.model_id, cfg.weights.revision))
        else:
            problems += weights.verify(Path(req.workload.model.path), cfg.weights.files)
    choice = None
    if cfg.weights.location == "external" and r.driver.boundary != "template":
        choice = weight_paths.choose(cfg, req.workload.weights, r.adapter)
        problems += [choice.problem] if choice.problem else []
    return problems, choice


def prepare_restore(req: RestoreRequest, *, store: CapsuleStore, progress: Progress = QUIET) -> PreparedRestore:
    """Admission and staging: everything that can fail before the old workload is stopped."""
    rb = ReceiptBuilder("restore", request_sha256=req.digest())
    rb.capsule_ref = req.capsule.ref
    t = time.monotonic()
    staging: Path | None = None
    try:
        with rb.phase("prepare.open"):
            cap = capsule_mod.open_capsule(store, req.capsule.ref)
            rb.capsule = cap.digest
        with rb.phase("prepare.admission"):
            r = resolve(req.workload)
            if cap.config.driver != r.driver.name:
                raise CompatibilityError("capsule %s was captured with driver %s, the recipe asks for %s" % (req.capsule.ref, cap.config.driver, r.driver.name))
            problems, choice = admission(cap, req, r)
            if problems:
                raise CompatibilityError("admission refused for capsule %s: %s" % (req.capsule.ref, "; ".join(problems)))
        total = sum(d.size for d in cap.layers)
        unpacked = sum(int((d.annotations or {}).get(media.A_UNPACKED_SIZE, d.size)) for d in cap.layers)
        staging = new_restore_staging(store, unpacked)
        with rb.phase("prepare.stage"), progress.transfer("verifying and unpacking capsule %s" % req.capsule.ref, total) as tick:
            for d in cap.layers:
                unpack_layer(store, d, staging / "units", tick=tick)
        prepared = PreparedRestore(req, cap, staging, r, rb, weights=choice)
        unit = cap.config.units[0]
        if "container" in unit.driver_data:
            with rb.phase("prepare.container"):
                spec = ContainerSpec.from_json(unit.driver_data["container"], labels=req.workload_labels, env=req.workload.launch.env, volumes=req.workload.launch.volumes)
                temp = "coldsnap-restore-%s-%s" % (req.capsule.name, os.path.basename(staging)[-8:].lower())
                prepared.container = r.driver.prepare_container(unit, staging / "units" / unit.name, spec, temp)
            shutil.rmtree(staging, ignore_errors=True)  # the container holds its own copy now
        else:
            with rb.phase("prepare.warm_up"):
                prepared.warm = r.driver.warm_up(unit)
        if choice is not None:
            prepared.weights = _cache_weights(cap, req, choice, rb, progress)
        prepared.prepare_seconds = time.monotonic() - t
        return prepared
    except BaseException as err:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, ColdsnapError):
            err.receipt = finish(rb, err)  # type: ignore[attr-defined]
        raise


def _cache_weights(cap: Capsule, req: RestoreRequest, choice: weight_paths.WeightChoice, rb: ReceiptBuilder, progress: Progress) -> weight_paths.WeightChoice:
    """Read the files hydration will read into the page cache now, while the old workload still serves."""
    if page_cache.switched_off():
        rb.details["weights_cache"] = {"skipped": "COLDSNAP_WEIGHTS_CACHE=off"}
        return choice
    files = weight_paths.files_to_read(cap.config, choice, req.workload.model.path)
    if not files:
        return choice
    t = time.monotonic()
    try:
        plan = page_cache.plan(files)
        if not plan.fits:
            rb.details["weights_cache"] = {"skipped": plan.why_not()}
            return choice
        with rb.phase("prepare.weights_cache"), progress.transfer("reading %d weight file(s) into the page cache" % len(files), plan.total) as tick:
            read = page_cache.read_ahead(files, tick)
    except OSError as err:  # only a head start: hydration reads the files itself and reports what is wrong
        rb.details["weights_cache"] = {"skipped": "reading %s failed: %s" % (err.filename or "a weight file", err.strerror)}
        return choice
    rb.details["weights_cache"] = {"bytes": read, "seconds": round(time.monotonic() - t, 4)}
    return dataclasses.replace(choice, cached=True)


@dataclass
class RestoreOutcome:
    receipt: Receipt
    root_pid: int
    ttft_seconds: float | None
    unit: object = None  # what stops it: a host process tree or a container


def activate_restore(prepared: PreparedRestore, *, log_path: Path, progress: Progress = QUIET) -> RestoreOutcome:
    """Restore the staged capsule, hydrate, validate; the result is a running, validated workload."""
    rb, req, cap, r = prepared.receipt, prepared.request, prepared.capsule, prepared.resolved
    w = req.workload
    running = None
    try:
        holder = port_holder(w.launch.port)
        if holder:
            raise RestoreError("port %d is in use by %s: stop that workload before restoring" % (w.launch.port, holder))
        unit: UnitImage = cap.config.units[0]
        t0 = time.monotonic()
        with rb.phase("restore"):
            if prepared.container is not None:
                running = r.driver.start_container(prepared.container, req.workload_name, progress.step)
                prepared.container = None
                root_pid = running.root_pid
            else:
                warm, prepared.warm = prepared.warm, None
                restored = r.driver.restore(unit, prepared.staging / "units" / unit.name, log_path=log_path, progress=progress.step, owned_dir=prepared.staging, warm=warm)
                root_pid = restored.root_pid
                running = StartedUnit(root_pid, None, log_path)
                if restored.images_handed_over:
                    prepared.handed_over()
        endpoint = r.adapter.endpoint(w.launch.command, w.model.id, w.launch.port)
        if r.driver.boundary == "template":
            # Past its boundary the engine initializes the accelerator and loads its weights itself.
            with rb.phase("engine_init"), progress.waiting("engine initializing after the template boundary"):
                r.adapter.wait_ready(endpoint, alive=running.alive, timeout=req.ready_timeout_seconds)
            rb.weights = Weights(path="engine-load")
        elif prepared.weights is not None:
            choice = prepared.weights
            with rb.phase("hydrate"), progress.waiting("hydrating weights (%s)" % choice.path):
                h = r.adapter.hydrate(
                    endpoint, path=choice.path, model_dir=w.model.path or "", native_dir=str(choice.native_dir) if choice.native_dir else None, cached=choice.cached
                )
            source = weight_paths.source_files(cap.config, choice.path)
            rb.weights = Weights(path=h.path, seconds=round(h.seconds, 4), files=len(source), bytes=sum(f.size for f in source), note=choice.note)
            if h.details:
                rb.details["hydrate"] = list(h.details)
        else:
            rb.weights = Weights(path="in-image")
        expected = req.validation.expected_reply or cap.config.validation.reply
        with rb.phase("validate"):
            validation = _validate(r, endpoint, req, t0, expected)
        rb.validation = validation
        if not validation.passed:
            raise ValidationError("restored workload replied %r, capsule %s recorded %r: the capsule does not match this host; recapture" % (validation.reply, req.capsule.ref, expected))
        rb.details["prepare_seconds"] = round(prepared.prepare_seconds, 4)
        rb.details["root_pid"] = root_pid
        return RestoreOutcome(finish(rb, None), root_pid, validation.ttft_seconds, running)
    except BaseException as err:
        _stop_quietly(running, err)
        if isinstance(err, ColdsnapError):
            err.receipt = finish(rb, err)  # type: ignore[attr-defined]
        raise
    finally:
        prepared.discard()


# -- vanilla start ---------------------------------------------------------------------


@dataclass
class VanillaOutcome:
    receipt: Receipt
    root_pid: int
    ttft_seconds: float | None
    unit: object = None


def start_vanilla(req: RestoreRequest, *, base_env: Mapping[str, str], log_path: Path, progress: Progress = QUIET, on_started=None) -> VanillaOutcome:
    """Start the engine the ordinary way (no capsule), wait, validate."""
    rb = ReceiptBuilder("start", request_sha256=req.digest())
    w = req.workload
    running = None
    try:
        r = resolve(w)
        holder = port_holder(w.launch.port)
        if holder:
            raise RestoreError("port %d is in use by %s: stop that workload first" % (w.launch.port, holder))
        env = launch_env(w, r, base_env)
        progress.step("starting %s vanilla" % w.engine)
        started_cb = on_started or (lambda pid: None)
        endpoint = r.adapter.endpoint(w.launch.command, w.model.id, w.launch.port)
        with rb.phase("launch"):
            t0 = time.monotonic()
            unit = running = launch_unit(w, w.launch.command, env, log_path, name=req.workload_name, labels=req.workload_labels)
            root_pid = unit.root_pid
            started_cb(root_pid)
        _ready(r, endpoint, unit, log_path, rb, progress, req.ready_timeout_seconds)
        with rb.phase("validate"):
            validation = _validate(r, endpoint, req, t0, req.validation.expected_reply)
        rb.validation = validation
        if not validation.passed:
            raise ValidationError("the engine replied %r, the recipe expects %r" % (validation.reply, validation.expected_reply))
        rb.details["root_pid"] = root_pid
        return VanillaOutcome(finish(rb, None), root_pid, validation.ttft_seconds, running)
    except BaseException as err:
        _stop_quietly(running, err)
        if isinstance(err, ColdsnapError):
            err.receipt = finish(rb, err)  # type: ignore[attr-defined]
        raise
