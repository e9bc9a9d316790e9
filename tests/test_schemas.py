"""The committed JSON Schemas are the ones the models generate, and real documents validate."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
from conftest import ROOT

from sparkrun_coldsnap.documents import schemas
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
from sparkrun_coldsnap.errors import CompatibilityError

SCHEMAS = ROOT / "docs" / "schemas"


@pytest.mark.parametrize("name", sorted(schemas.generate()))
def test_committed_schema_matches_the_model(name):
    committed = (SCHEMAS / name).read_text()
    assert committed == schemas.render(schemas.generate()[name]), "regenerate with: python -m sparkrun_coldsnap.documents.schemas docs/schemas"


def test_receipts_validate_against_their_schema():
    schema = json.loads((SCHEMAS / "receipt.schema.json").read_text())
    rb = ReceiptBuilder("restore", request_sha256="sha256:" + "0" * 64)
    with rb.phase("restore"):
        time.sleep(0.05)
    time.sleep(0.1)  # time outside every phase: the receipt calls it unaccounted
    ok = rb.finish("succeeded").model_dump(mode="json")
    refused = rb.finish("refused", CompatibilityError("admission refused: kernel_release differs")).model_dump(mode="json")
    for doc in (ok, refused):
        jsonschema.validate(doc, schema)
    assert refused["error"] == {"code": "admission.refused", "message": "admission refused: kernel_release differs", "phase": "restore"}
    assert [p["name"] for p in ok["phases"]] == ["restore"] and ok["phases"][0]["seconds"] >= 0.05
    assert 0.1 <= ok["unaccounted_seconds"] < 1.0
    assert ok["total_seconds"] == pytest.approx(ok["phases"][0]["seconds"] + ok["unaccounted_seconds"], abs=1e-3)
