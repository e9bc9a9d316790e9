"""A trust policy: which public keys a capsule's signature must verify with, and whether one is required."""

from __future__ import annotations

from pydantic import Field

from sparkrun_coldsnap.documents.strict import Strict
from sparkrun_coldsnap.documents.values import PathText


class TrustPolicy(Strict):
    keys: tuple[PathText, ...] = Field(min_length=1, description="PEM public keys (cosign/sigstore .pub files) a capsule's signature may verify with.")
    require: bool = Field(
        True,
        description="A capsule must carry a signature by one of the keys. False: an unsigned capsule is admitted, but one whose signatures none of the keys verifies is still refused.",
    )
