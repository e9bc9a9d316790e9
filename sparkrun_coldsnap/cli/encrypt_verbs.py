"""``encrypt``: a capsule's layers encrypted in the store, as skopeo's ``--encryption-key jwe:`` writes them."""

from __future__ import annotations

import click

from sparkrun_coldsnap.cli.common import emit_json, open_store, plain_store_option
from sparkrun_coldsnap.digests import short
from sparkrun_coldsnap.progress import Progress


@click.command("encrypt")
@click.argument("capsule")
@click.option("--recipient", "recipients", multiple=True, required=True, help="PEM public key (RSA, or EC P-256/P-384/P-521) whose private key may decrypt the layers; repeat for several recipients.")
@click.option("--as", "target", default=None, help="Tag the encrypted capsule NAME[:TAG] and keep CAPSULE as it is (default: replace CAPSULE, removing its plaintext layers from the store).")
@plain_store_option
@click.option("--json", "as_json", is_flag=True, help="Print the encrypted capsule's reference and digest as JSON.")
def encrypt(capsule, recipients, target, store, as_json):
    """Encrypt CAPSULE's layers for the --recipient public keys (OCI encrypted layers, keys
    wrapped as JWE). The config is unchanged; the store keeps the ciphertext; a restore
    decrypts into its staging directory with COLDSNAP_DECRYPTION_KEY; `skopeo copy
    --decryption-key` reads it too. An encrypted capsule publishes without --allow-secrets."""
    from sparkrun_coldsnap.capsule import capsule_crypto, layer_crypto

    keys = [layer_crypto.load_public_key(r) for r in recipients]  # refused before anything is written
    cap = capsule_crypto.encrypt(open_store(store).init(), capsule, keys, target=target, progress=Progress(quiet=as_json))
    if as_json:
        emit_json({"ref": cap.ref, "digest": cap.digest, "layers": [d.to_json() for d in cap.layers]})
        return
    click.echo("encrypted %s as %s (%s) for %d recipient(s)" % (capsule, cap.ref, short(cap.digest), len(keys)))


COMMANDS = [encrypt]
