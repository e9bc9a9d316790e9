"""JSON Schemas of the public documents, generated from the models.

``python -m sparkrun_coldsnap.schemas docs/schemas`` rewrites the committed
files; a test fails when they drift from the models.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel

from sparkrun_coldsnap.capabilities import Capabilities
from sparkrun_coldsnap.documents.capsule_config import CapsuleConfig
from sparkrun_coldsnap.documents.receipts import Receipt
from sparkrun_coldsnap.documents.recipe_block import ColdsnapBlock
from sparkrun_coldsnap.documents.request import CaptureRequest, RestoreRequest

BASE = "https://sparkrun-coldsnap.invalid/schemas/"

DOCUMENTS: dict[str, type[BaseModel]] = {
    "capture-request": CaptureRequest,
    "restore-request": RestoreRequest,
    "capsule-config": CapsuleConfig,
    "receipt": Receipt,
    "capabilities": Capabilities,
    "recipe-coldsnap-block": ColdsnapBlock,
}


def generate() -> dict[str, dict]:
    out = {}
    for name, model in DOCUMENTS.items():
        schema = model.model_json_schema(mode="serialization")
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": BASE + name + ".schema.json", **schema}
        out[name + ".schema.json"] = schema
    return out


def render(schema: dict) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def write(target: Path) -> list[Path]:
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in generate().items():
        path = target / name
        path.write_text(render(schema))
        written.append(path)
    return written


if __name__ == "__main__":
    for p in write(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/schemas")):
        print(p)
