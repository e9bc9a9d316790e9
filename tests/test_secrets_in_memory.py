"""What a capsule's memory holds of the credentials a recipe gives, with the real CPU vLLM engine.

One capture of a recipe that carries a hub token in its environment, a hub token flag, a token
file it points the hub client at, and an API key the engine serves with. Every blob of the
capsule in the store is read, every layer unpacked (the CRIU images themselves), and searched for
each value: what fetches weights is not in them; the API key is, and the capsule says so by name,
so `publish` refuses it unless told `--allow-secrets`.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest
from conftest import require_engine, write_recipe
from test_engine_cycle import PROMPT, engine_processes, wait_gone

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule.pack import unpack_layer
from sparkrun_coldsnap.capsule.store import CapsuleStore

pytestmark = pytest.mark.engine


def marker(what: str) -> str:
    return "coldsnap-%s-%s" % (what, secrets.token_hex(12))


def where_found(store_dir: Path, ref: str, needles: dict[str, str], scratch: Path) -> dict[str, list[str]]:
    """For each needle, the store files and unpacked image files that hold its bytes."""
    store = CapsuleStore(store_dir)
    cap = capsule_mod.open_capsule(store, ref)
    files = [p for p in store_dir.rglob("*") if p.is_file()]  # every blob, index and receipt, as stored
    unpacked = scratch / "unpacked"
    for d in cap.layers:
        unpack_layer(store, d, unpacked)  # decompressed: the CRIU images the restore reads
    files += [p for p in unpacked.rglob("*") if p.is_file()]
    assert any(p.name.startswith("pages-") for p in files), "no memory pages among %d files" % len(files)
    found: dict[str, list[str]] = {name: [] for name in needles}
    for path in files:
        data = path.read_bytes()
        for name, needle in needles.items():
            if needle.encode() in data:
                found[name].append(str(path.relative_to(scratch)))
    return found


def test_a_capsule_holds_no_fetch_credential_and_names_the_key_it_serves_with(sparkrun, tmp_path):
    require_engine()
    assert not engine_processes(), "an engine is already running; stop it first"
    env_token, flag_token, file_token, api_key = marker("env"), marker("flag"), marker("file"), marker("apikey")
    token_file = tmp_path / ("hub-token-%s" % secrets.token_hex(12))
    token_file.write_text(file_token)
    store = tmp_path / "store"
    block = "coldsnap:\n  engine_env: vllm-cpu\n  capsule:\n    name: keyed\n    store: %s\n  validation:\n    prompt: %r\n    max_tokens: 16\n" % (store, PROMPT)
    recipe = write_recipe(
        tmp_path, coldsnap=block, name="keyed.yaml",
        replace={
            '  HF_HUB_OFFLINE: "1"\n': '  HF_HUB_OFFLINE: "1"\n  HF_TOKEN: "%s"\n  HF_TOKEN_PATH: "%s"\n' % (env_token, token_file),
            "--dtype {dtype}\n": "--dtype {dtype} --hf-token %s --api-key %s\n" % (flag_token, api_key),
        },
    )  # fmt: skip
    receipt_path = tmp_path / "capture-receipt.json"
    try:
        sparkrun.coldsnap("capture", str(recipe), "-H", "localhost", "--receipt", str(receipt_path))
    finally:
        wait_gone()
    receipt = json.loads(receipt_path.read_text())
    assert receipt["state"] == "succeeded" and receipt["validation"]["passed"]  # validated through the API key
    assert receipt["details"]["credentials"] == {"withheld": ["--hf-token", "HF_TOKEN", "HF_TOKEN_PATH"], "held": ["--api-key"]}

    found = where_found(store, "keyed", {"env": env_token, "flag": flag_token, "file path": str(token_file), "file content": file_token, "api key": api_key}, tmp_path)
    assert found["env"] == found["flag"] == found["file path"] == found["file content"] == [], found
    # The engine serves with the key, so its memory holds it: the marking below is not for show.
    assert any("/pages-" in p for p in found["api key"]), found["api key"]

    config = sparkrun.json("inspect", "keyed", "--store", str(store), "--json")["config"]
    assert config["credentials"] == ["--api-key"]
    assert "credentials in memory: --api-key" in sparkrun.coldsnap("inspect", "keyed", "--store", str(store)).stdout
    # Refused before any connection is made (nothing listens on port 9); allowed, it goes on to the registry.
    refused = sparkrun.coldsnap("publish", "keyed", "127.0.0.1:9/capsules:keyed", "--plain-http", "--store", str(store), check=False)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "capsule keyed holds credentials in its memory (--api-key)" in lines[0] and "--allow-secrets" in lines[0], lines[0]
    allowed = sparkrun.coldsnap("publish", "keyed", "127.0.0.1:9/capsules:keyed", "--plain-http", "--store", str(store), "--allow-secrets", check=False)
    assert allowed.returncode != 0 and "holds credentials" not in allowed.stderr and "127.0.0.1:9" in allowed.stderr, allowed.stderr
