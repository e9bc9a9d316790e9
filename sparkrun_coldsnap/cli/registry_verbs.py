"""``publish`` and ``pull``: capsules to and from an OCI registry."""

from __future__ import annotations

from pathlib import Path

import click

from sparkrun_coldsnap.cli.common import emit_json, open_store, plain_store_option
from sparkrun_coldsnap.digests import short


def chunk_option(f):
    return click.option("--chunk-size", type=click.IntRange(1 << 16, 1 << 30), default=16 << 20, show_default=True, help="Upload chunk size in bytes (an interrupted upload resumes from its last whole chunk).")(f)


def transport_options(f):
    f = click.option("--ca-file", type=click.Path(exists=True, dir_okay=False), default=None, help="CA certificate bundle for the registry's TLS certificate.")(f)
    f = click.option("--plain-http", is_flag=True, help="Use plain HTTP (a registry on loopback, say).")(f)
    return f


def client_for(ref, plain_http: bool, ca_file: str | None):
    from sparkrun_coldsnap.capsule.registry import RegistryClient, Transport

    return RegistryClient(ref, Transport(plain_http=plain_http, ca_file=ca_file))


def model_dir_of(cap) -> Path:
    from sparkrun_coldsnap.host import paths

    w = cap.config.weights
    return paths.hf_snapshot_dir(w.model_id, w.revision)


@click.command("publish")
@click.argument("capsule")
@click.argument("repository")
@plain_store_option
@transport_options
@chunk_option
@click.option("--with-weights", is_flag=True, help="Also push the model files as a weights artifact, linked as the capsule's subject.")
@click.option("--with-native", is_flag=True, help="Also push the capsule's native weight payload from this host, as an artifact referring to the capsule.")
@click.option("--allow-secrets", is_flag=True, help="Publish a capsule whose memory holds credentials (inspect names them): whoever can pull it can read them. Not needed for a capsule whose layers are all encrypted (encrypt).")
@click.option("--sign", "sign_key", type=click.Path(exists=True, dir_okay=False), default=None, help="Sign the published manifest with this private key (cosign/sigstore or PEM ECDSA), as skopeo and cosign attach signatures.")
@click.option("--passphrase-file", type=click.Path(exists=True, dir_okay=False), default=None, help="File whose first line is the --sign key's passphrase.")
@click.option("--json", "as_json", is_flag=True, help="Print what was pushed as JSON.")
def publish(capsule, repository, store, plain_http, ca_file, chunk_size, with_weights, with_native, allow_secrets, sign_key, passphrase_file, as_json):
    """Push CAPSULE (name[:tag] or digest) from the local store to REPOSITORY[:TAG] of an OCI registry.

    Credentials come from the usual Docker/OCI credential files (docker login)
    or ORAS_USER/ORAS_PASS, never from recipes.
    """
    from sparkrun_coldsnap.capsule import capsule as capsule_mod
    from sparkrun_coldsnap.capsule.reference import parse
    from sparkrun_coldsnap.capsule.transfer import publish as do_publish
    from sparkrun_coldsnap.progress import Progress

    s = open_store(store)
    ref = parse(repository, default_tag=None)
    cap = capsule_mod.open_capsule(s, capsule)
    model_dir = model_dir_of(cap) if with_weights else None
    key = None
    if sign_key:  # opened before anything is pushed: a wrong passphrase stops the publish here
        from sparkrun_coldsnap.capsule.signing_keys import load_private_key, read_passphrase

        key = load_private_key(sign_key, read_passphrase(passphrase_file))
    result = do_publish(
        s, capsule, ref, client_for(ref, plain_http, ca_file), model_dir=model_dir, with_native=with_native, chunk=chunk_size, progress=Progress(quiet=as_json),
        allow_secrets=allow_secrets, sign_with=key,
    )  # fmt: skip
    if as_json:
        emit_json(result.__dict__)
        return
    click.echo("published %s as %s (%s); %d blobs pushed, %d already there" % (capsule, result.reference, short(result.digest), result.blobs_pushed, result.blobs_present))
    if result.weights:
        click.echo("  weights artifact %s is its subject" % short(result.weights))
    if result.native:
        click.echo("  native weight payload %s refers to it" % short(result.native))
    if result.signature:
        click.echo("  signed: %s" % result.signature)


@click.command("pull")
@click.argument("reference")
@plain_store_option
@transport_options
@click.option("--as", "local_ref", default=None, help="Local name[:tag] (default: the capsule's own name and the reference's tag).")
@click.option("--with-weights", is_flag=True, help="Also fetch the model files from the capsule's weights artifact.")
@click.option("--with-native", is_flag=True, help="Also fetch the capsule's native weight payload, for the native weight path.")
@click.option("--trust-key", "trust_keys", multiple=True, type=click.Path(exists=True, dir_okay=False), help="Require a signature by this PEM public key (repeatable: any of them); refused before anything is fetched.")
@click.option("--json", "as_json", is_flag=True, help="Print what was pulled as JSON.")
def pull(reference, store, plain_http, ca_file, local_ref, with_weights, with_native, trust_keys, as_json):
    """Pull a capsule from an OCI registry into the local store (REGISTRY/REPO[:TAG|@DIGEST]).
    Its signatures come with it (a restore under a trust policy checks them)."""
    from sparkrun_coldsnap.capsule.reference import parse
    from sparkrun_coldsnap.capsule.transfer import pull_with_companions
    from sparkrun_coldsnap.documents.trust import TrustPolicy
    from sparkrun_coldsnap.progress import Progress

    s = open_store(store)
    ref = parse(reference)
    trust = TrustPolicy(keys=tuple(trust_keys)) if trust_keys else None
    got = pull_with_companions(
        client_for(ref, plain_http, ca_file), ref, s, local_ref=local_ref, model_dir_of=model_dir_of,
        want_weights=lambda cap: with_weights, want_native=lambda cap: with_native, progress=Progress(quiet=as_json), trust=trust,
    )  # fmt: skip
    result, fetched, native = got.result, got.weight_files, got.native_files
    cap = result.capsule
    if as_json:
        emit_json(
            {
                "ref": cap.ref, "digest": cap.digest, "store": str(s.root), "blobs_fetched": result.blobs_fetched, "blobs_present": result.blobs_present,
                "weight_files_fetched": fetched, "native_files_fetched": native,
            }
        )  # fmt: skip
        return
    click.echo("pulled %s -> %s (%s) in %s; %d blobs fetched, %d already here" % (reference, cap.ref, short(cap.digest), s.root, result.blobs_fetched, result.blobs_present))
    if with_weights:
        click.echo("  %d model file(s) fetched into %s" % (fetched, model_dir_of(cap)))
    if with_native:
        from sparkrun_coldsnap.weights import native_payload

        click.echo("  native weight payload: %d file(s) fetched into %s" % (native, native_payload.directory(cap.config.weights.native)))


@click.command("remote")
@click.argument("repository")
@transport_options
@click.option("--json", "as_json", is_flag=True, help="Print the repository's capsules as JSON.")
def remote(repository, plain_http, ca_file, as_json):
    """List the capsules in a registry repository: by tag, and as referrers of its weights artifacts."""
    from sparkrun_coldsnap.capsule.reference import parse
    from sparkrun_coldsnap.capsule.transfer import remote_capsules

    ref = parse(repository, default_tag=None)
    rows = remote_capsules(client_for(ref, plain_http, ca_file))
    if as_json:
        emit_json({"repository": "%s/%s" % (ref.registry, ref.repository), "capsules": rows})
        return
    if not rows:
        click.echo("no capsules in %s/%s" % (ref.registry, ref.repository))
    for r in rows:
        a = r.get("annotations", {})
        click.echo("%-24s %-20s %-30s %s" % (r.get("tag") or "-", short(r.get("digest", "")), a.get("dev.sparkrun.coldsnap.model", ""), r.get("found_by", r.get("error", ""))))


COMMANDS = [publish, pull, remote]
