"""A restore hands what it reads to CRIU running as root: a store another user owns or can
write is refused before anything is read from it, and what the store writes is not for others."""

from __future__ import annotations

import os
import stat

import pytest
from helpers import make_capsule, synthetic_workload

from sparkrun_coldsnap import api
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder, write_receipt
from sparkrun_coldsnap.documents.request import CapsuleRef, RestoreRequest, ValidationSpec
from sparkrun_coldsnap.errors import UntrustedStoreError

NOBODY = 65534


def request() -> RestoreRequest:
    return RestoreRequest(workload=synthetic_workload(), validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="synthetic"), on_missing="fail", workload_name="w")


@pytest.mark.parametrize(
    "spoil, expected",
    [
        (lambda s: os.chmod(s.root, 0o777), "writable by others"),
        (lambda s: os.chmod(s.root / "index.json", 0o664), "writable by its group"),
        (lambda s: os.chmod(s.blobs, 0o757), "writable by others"),
        (lambda s: os.chown(s.root / "index.json", NOBODY, -1), "owned by uid 65534"),
        (lambda s: os.chown(s.blobs, NOBODY, -1), "owned by uid 65534"),
    ],
)
def test_a_restore_refuses_a_store_others_could_change(tmp_path, spoil, expected):
    store = CapsuleStore(tmp_path / "store")
    make_capsule(store, tmp_path, pages_mb=1)
    api.verify("synthetic", store=store.root)  # intact: the capsule itself is fine
    spoil(store)
    with pytest.raises(UntrustedStoreError) as caught:
        api.prepare(request(), store=store.root)
    assert expected in caught.value.message and caught.value.exit_code == 2
    receipt = caught.value.receipt
    assert receipt is not None and receipt.state == "failed" and receipt.error is not None and receipt.error.phase == "prepare.open"


def test_capsules_and_receipts_are_not_for_other_users(tmp_path):
    store = CapsuleStore(tmp_path / "store")
    make_capsule(store, tmp_path, pages_mb=1)
    for p in [store.root, store.blobs, store.root / "index.json", *store.blobs.iterdir()]:
        assert stat.S_IMODE(p.stat().st_mode) & 0o007 == 0, p
    path = write_receipt(ReceiptBuilder("restore").finish("succeeded"), store.receipts / "x" / "r.json")
    assert stat.S_IMODE(path.stat().st_mode) & 0o007 == 0
