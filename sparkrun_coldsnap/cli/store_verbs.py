"""Verbs on the local capsule store: list, inspect, verify, delete."""

from __future__ import annotations

import click

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule import capsule_crypto, gc
from sparkrun_coldsnap.cli.common import emit_json, open_store, plain_store_option
from sparkrun_coldsnap.digests import short
from sparkrun_coldsnap.errors import ColdsnapError
from sparkrun_coldsnap.host import leftovers
from sparkrun_coldsnap.progress import Progress
from sparkrun_coldsnap.weights import native_payload


def _summary(cap: capsule_mod.Capsule) -> dict:
    c = cap.config
    return {
        "ref": cap.ref,
        "digest": cap.digest,
        "created": c.created,
        "engine": "%s %s" % (c.engine.name, c.engine.version or ""),
        "driver": c.driver,
        "model": "%s@%s" % (c.workload.model.id, c.workload.model.revision),
        "weights": c.weights.location,
        "size": cap.size,
    }


@click.command("list")
@plain_store_option
@click.option("--json", "as_json", is_flag=True, help="Print the capsules as JSON.")
def list_capsules(store, as_json):
    """List the capsules in the local store."""
    s = open_store(store)
    rows = []
    for entry in s.entries():
        try:
            rows.append(_summary(capsule_mod.open_entry(s, entry)))
        except ColdsnapError as err:
            rows.append({"ref": entry.ref, "digest": entry.descriptor.digest, "error": err.message})
    if as_json:
        emit_json({"store": str(s.root), "capsules": rows})
        return
    if not rows:
        click.echo("no capsules in %s" % s.root)
        return
    click.echo("%-28s %-20s %-12s %-6s %10s  %s" % ("CAPSULE", "DIGEST", "ENGINE", "DRIVER", "SIZE", "CREATED"))
    for r in rows:
        if "error" in r:
            click.echo("%-28s %-20s damaged: %s" % (r["ref"], short(r["digest"]), r["error"]))
            continue
        click.echo("%-28s %-20s %-12s %-6s %7.1f MB  %s" % (r["ref"], short(r["digest"]), r["engine"].strip(), r["driver"], r["size"] / 1e6, r["created"]))


@click.command("inspect")
@click.argument("capsule")
@plain_store_option
@click.option("--json", "as_json", is_flag=True, help="Print manifest and config as JSON.")
def inspect(capsule, store, as_json):
    """Show a capsule's manifest, config and layers (CAPSULE is name[:tag] or a digest)."""
    s = open_store(store)
    cap = capsule_mod.open_capsule(s, capsule)
    if as_json:
        emit_json({"ref": cap.ref, "digest": cap.digest, "manifest": cap.manifest, "config": cap.config.model_dump(mode="json")})
        return
    c = cap.config
    for k, v in _summary(cap).items():
        click.echo("%-9s %s" % (k + ":", v if k != "size" else "%.1f MB" % (v / 1e6)))
    click.echo("request:  %s" % c.request_sha256)
    click.echo("command:  %s" % c.workload.launch.command)
    click.echo("validation: %r -> %r" % (c.validation.prompt, c.validation.reply))
    # By name only: the images hold the values, and publish refuses them without --allow-secrets.
    sealed = "; every layer encrypted" if capsule_crypto.fully_encrypted(cap) else ""
    click.echo("credentials in memory: %s%s" % (", ".join(c.credentials) if c.credentials else "none", sealed))
    if c.weights.native is not None:
        d = native_payload.directory(c.weights.native)  # presence only: restores verify the digests
        where = "on this host, in %s" % d if d.is_dir() else "not on this host (restores take recovery)"
        size = sum(f.size for f in c.weights.native.files) / 1e6
        click.echo("native weights: %s, %.1f MB: %s" % (short(c.weights.native.digest), size, where))
    fp = c.fingerprint
    click.echo("fingerprint: %s, kernel %s, criu %s, %s %s, python %s, torch %s, gpus %s" % (
        fp.cpu_arch, fp.kernel_release, fp.criu_version, fp.engine, fp.engine_version or "(version not recorded)",
        fp.python_version or "not recorded", fp.torch_version or "not recorded", len(fp.gpus)))  # fmt: skip
    if c.workload.launch.image:
        click.echo("image:    %s (%s)" % (c.workload.launch.image.split("@", 1)[0], c.workload.launch.image.split("@", 1)[-1]))
    click.echo("layers:")
    for d in cap.layers:
        a = d.annotations or {}
        click.echo("  %s %-40s %9.1f MB  %s" % (short(d.digest), a.get("org.opencontainers.image.title", ""), d.size / 1e6, d.media_type.rsplit(".", 1)[-1]))
    for u in c.units:
        click.echo("unit %s on %s: %d processes, %.1f MB of images, %d shared files" % (u.name, u.host, len(u.pids), u.image_bytes / 1e6, len(u.shared_files)))


@click.command("verify")
@click.argument("capsule")
@plain_store_option
@click.option("--json", "as_json", is_flag=True, help="Print what was verified as JSON.")
def verify(capsule, store, as_json):
    """Re-hash every blob of a capsule; fails on the first that does not match its digest."""
    s = open_store(store)
    cap = capsule_mod.open_capsule(s, capsule)
    progress = Progress(quiet=as_json)
    total = sum(d.size for d in cap.layers)
    with progress.transfer("verifying %s" % capsule, total):
        checked = capsule_mod.verify(s, cap)
    if as_json:
        emit_json({"ref": cap.ref, "digest": cap.digest, "verified_bytes": checked, "blobs": len(cap.layers) + 2, "ok": True})
    else:
        click.echo("%s (%s): manifest, config and %d layers verified (%.1f MB)" % (capsule, short(cap.digest), len(cap.layers), checked / 1e6))


def _native_digests(s) -> set[str]:
    """Native payloads the store's remaining capsules were written with."""
    found = set()
    for entry in s.entries():
        try:
            record = capsule_mod.open_entry(s, entry).config.weights.native
        except ColdsnapError:  # a damaged capsule keeps nothing alive
            continue
        if record is not None:
            found.add(record.digest)
    return found


@click.command("delete")
@click.argument("capsule")
@plain_store_option
@click.option("--keep-native", is_flag=True, help="Keep the capsule's native weight payload on this host.")
def delete(capsule, store, keep_native):
    """Remove a capsule from the local store and free blobs no other capsule uses, and its native weight payload."""
    s = open_store(store)
    try:
        native = capsule_mod.open_capsule(s, capsule).config.weights.native
    except ColdsnapError:  # damaged: deleting it must still work
        native = None
    entry = s.untag(capsule)
    freed = gc.collect(s, apply=True, transfers=False)
    click.echo("deleted %s (%s); freed %d blobs, %.1f MB" % (entry.ref or capsule, short(entry.descriptor.digest), len(freed.blobs), freed.bytes / 1e6))
    if native is not None and not keep_native and native.digest not in _native_digests(s):
        freed = native_payload.remove(native)
        if freed:
            click.echo("removed its native weight payload %s, %.1f MB" % (short(native.digest), freed / 1e6))


@click.command("gc")
@plain_store_option
@click.option("--yes", "--apply", "apply", is_flag=True, help="Free what is shown (without it, only show).")
@click.option("--json", "as_json", is_flag=True, help="Print what was found (and freed) as JSON.")
def collect_garbage(store, apply, as_json):
    """Show what the store holds that nothing needs (blobs no capsule references, staging left by
    interrupted operations, partial transfers); --yes frees it."""
    s = open_store(store)
    found = gc.collect(s, apply=apply)
    if apply:
        # Also what a capture killed outright left on the host: its engine, io_uring switched off.
        recovered = leftovers.recover()
        for what in recovered.stopped:
            click.echo("stopped %s" % what, err=as_json)
        if recovered.io_uring is not None:
            click.echo("put kernel.io_uring_disabled back to %s" % recovered.io_uring, err=as_json)
        if recovered.temp_files:
            click.echo("removed %d file(s) stopped engines left in /tmp (vLLM's sockets and init files)" % len(recovered.temp_files), err=as_json)
    if as_json:
        emit_json({"store": str(s.root), "applied": apply, **found.to_json()})
        return
    if not found.items:
        click.echo("nothing to free in %s" % s.root)
        return
    for label, rows in (("blob", found.blobs), ("staging", found.staging), ("transfer", found.transfers)):
        for path, size in rows:
            click.echo("%-8s %9.1f MB  %s" % (label, size / 1e6, path))
    verb = "freed" if apply else "would free"
    click.echo("%s %d blobs, %d staging directories, %d partial transfers: %.1f MB%s" % (
        verb, len(found.blobs), len(found.staging), len(found.transfers), found.bytes / 1e6, "" if apply else "; run with --yes to free them"))  # fmt: skip


COMMANDS = [list_capsules, inspect, verify, delete, collect_garbage]
