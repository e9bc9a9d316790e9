"""The validation reply token by token: what capture records and how a restore compares to it.

Text equality proves the restored engine answers; equal token ids with equal log-probabilities
prove it computes what the captured one did (the same weights, the same kernels, the same
cache state), down to rounding. The comparison lives in ``controller/oracle.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sparkrun_coldsnap.documents.strict import Strict

#: how far a restored log-probability may be from the recorded one (natural log, absolute)
DEFAULT_LOGPROB_TOLERANCE = 1e-3


class TokenRecord(Strict):
    """The generated tokens of one greedy reply, as the engine's OpenAI endpoint returned them."""

    ids: tuple[int, ...] = Field(min_length=1, description="Token ids of the reply, in order.")
    logprobs: tuple[float, ...] = Field(min_length=1, description="Log-probability of each token (greedy decoding: the top-1).")

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> TokenRecord:
        if len(self.ids) != len(self.logprobs):
            raise ValueError("%d token ids but %d log-probabilities: the record was altered; recapture" % (len(self.ids), len(self.logprobs)))
        return self


class TokenCheck(Strict):
    """A restore's reply against the capsule's token record."""

    oracle: Literal["tokens", "text"] = Field(description="tokens: ids and log-probabilities compared; text: only the text could be compared (see note).")
    note: str | None = Field(None, description="Why only the text was compared.")
    tokens: int | None = Field(None, description="Tokens compared (the recorded reply's).")
    ids_equal: bool | None = None
    max_abs_logprob_delta: float | None = Field(None, description="Largest |restored - recorded| log-probability over the tokens compared.")
    tolerance: float | None = Field(None, description="The largest difference allowed (coldsnap.validation.logprob_tolerance).")
    first_mismatch: int | None = Field(None, description="Index of the first token whose id differs or whose log-probability is beyond the tolerance.")

    @property
    def passed(self) -> bool:
        if self.oracle == "text":
            return True
        return bool(self.ids_equal) and self.first_mismatch is None
