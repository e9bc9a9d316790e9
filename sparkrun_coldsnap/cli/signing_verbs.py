"""``keygen``, ``sign`` and ``verify``: capsule signatures that skopeo and cosign also check."""

from __future__ import annotations

from pathlib import Path

import click

from sparkrun_coldsnap.cli.common import emit_json, open_store, plain_store_option
from sparkrun_coldsnap.cli.registry_verbs import client_for, transport_options
from sparkrun_coldsnap.digests import short


def passphrase_option(f):
    return click.option("--passphrase-file", type=click.Path(exists=True, dir_okay=False), default=None, help="File whose first line is the signing key's passphrase (as skopeo's --sign-passphrase-file).")(f)


@click.command("keygen")
@click.argument("prefix", type=click.Path(path_type=Path))
@click.option("--passphrase-file", type=click.Path(exists=True, dir_okay=False), required=True, help="File whose first line is the passphrase that encrypts the private key.")
def keygen(prefix, passphrase_file):
    """Write a new ECDSA P-256 key pair: PREFIX.key (cosign/sigstore's encrypted format, which
    skopeo's --sign-by-sigstore-private-key takes) and PREFIX.pub (the PEM public key a trust
    policy or a sigstoreSigned policy names)."""
    from sparkrun_coldsnap.capsule.signing_keys import read_passphrase, write_key_pair

    key, pub = write_key_pair(prefix, read_passphrase(passphrase_file) or b"")
    click.echo("wrote %s (private, encrypted) and %s (public)" % (key, pub))


@click.command("sign")
@click.argument("capsule")
@click.argument("reference", required=False)
@click.option("--key", "key_path", type=click.Path(exists=True, dir_okay=False), required=True, help="Private key: a cosign/sigstore key (`keygen`, cosign) or a PEM ECDSA key.")
@passphrase_option
@plain_store_option
@transport_options
@click.option("--json", "as_json", is_flag=True, help="Print what was signed as JSON.")
def sign(capsule, reference, key_path, passphrase_file, store, plain_http, ca_file, as_json):
    """Sign CAPSULE (name[:tag] or digest) in the local store; with REFERENCE (REGISTRY/REPO[:TAG]
    where it was published) also sign it there, as skopeo and cosign attach signatures."""
    from sparkrun_coldsnap.capsule import capsule as capsule_mod
    from sparkrun_coldsnap.capsule import signatures
    from sparkrun_coldsnap.capsule.reference import parse
    from sparkrun_coldsnap.capsule.signing_keys import load_private_key, read_passphrase

    s = open_store(store)
    cap = capsule_mod.open_capsule(s, capsule)
    key = load_private_key(key_path, read_passphrase(passphrase_file))
    ref = parse(reference, default_tag=None) if reference else None
    identity = str(ref) if ref else (cap.ref or cap.digest)
    signatures.keep(s, cap.digest, [signatures.sign(key, identity, cap.digest)])
    out = {"capsule": cap.ref or cap.digest, "digest": cap.digest, "store": str(s.root), "remote": None}
    if ref is not None:
        client = client_for(ref, plain_http, ca_file)
        digest = signatures.published_digest(client, ref, cap)
        sig = signatures.sign(key, identity, digest)
        out["remote"] = {"reference": str(ref), "digest": digest, "signatures": "%s/%s:%s" % (ref.registry, ref.repository, signatures.push_signature(client, digest, sig))}
        signatures.keep(s, digest, [sig])
    if as_json:
        emit_json(out)
        return
    click.echo("signed %s (%s) in %s" % (out["capsule"], short(cap.digest), s.root))
    if out["remote"]:
        click.echo("signed %s (%s): %s" % (ref, short(out["remote"]["digest"]), out["remote"]["signatures"]))


@click.command("verify-signature")
@click.argument("capsule")
@click.option("--trust-key", "keys", multiple=True, required=True, type=click.Path(exists=True, dir_okay=False), help="PEM public key a signature may verify with (repeatable).")
@plain_store_option
def verify_signature(capsule, keys, store):
    """Check that CAPSULE in the local store carries a signature by one of the --trust-key keys."""
    from sparkrun_coldsnap.capsule import capsule as capsule_mod
    from sparkrun_coldsnap.capsule import signatures
    from sparkrun_coldsnap.documents.trust import TrustPolicy
    from sparkrun_coldsnap.errors import CompatibilityError

    s = open_store(store)
    cap = capsule_mod.open_capsule(s, capsule)
    why = signatures.refusal(capsule, cap.digest, signatures.local_signatures(s, cap.digest), TrustPolicy(keys=tuple(keys)))
    if why:
        raise CompatibilityError(why, code="admission.untrusted")
    click.echo("capsule %s (%s) is signed by a trusted key" % (capsule, short(cap.digest)))


COMMANDS = [keygen, sign, verify_signature]
