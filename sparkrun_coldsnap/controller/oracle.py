"""The token oracle: a restored engine's validation reply against the one its capsule recorded.

The text must be the recorded text (``validation.failed`` otherwise). Where the capsule recorded
the reply token by token, the token ids must be identical and every log-probability within the
request's ``logprob_tolerance``: a reply whose text matches but whose tokens do not is a failed
validation of its own (``validation.tokens``: other ids; ``validation.logprobs``: the same ids
with other probabilities, an engine computing something else that happens to pick the same
words). A capsule without a record (captured before records were kept, or from an engine that
returns none) is judged by its text, and the receipt says so.
"""

from __future__ import annotations

from sparkrun_coldsnap.documents.capsule_config import CapturedValidation
from sparkrun_coldsnap.documents.receipts import Validation
from sparkrun_coldsnap.documents.request import ValidationSpec
from sparkrun_coldsnap.documents.tokens import TokenCheck, TokenRecord
from sparkrun_coldsnap.errors import ValidationError

NO_RECORD = "the capsule recorded no tokens (captured before token records were kept, or its engine returned none): the text alone was compared"
OTHER_REQUEST = "the recipe's validation prompt or max_tokens differ from the ones the capsule recorded: the text alone was compared"


def compare(recorded: TokenRecord, got: TokenRecord | None, tolerance: float) -> TokenCheck:
    """*got* token by token against *recorded*: ids equal, and the largest log-probability difference."""
    if got is None:
        return TokenCheck(oracle="tokens", tokens=len(recorded.ids), ids_equal=False, tolerance=tolerance, first_mismatch=0)
    ids_equal = got.ids == recorded.ids
    deltas = [abs(a - b) for a, b in zip(got.logprobs, recorded.logprobs, strict=False)]
    worst = max(deltas) if deltas else None
    first = next((i for i, (a, b) in enumerate(zip(got.ids, recorded.ids, strict=False)) if a != b), None)
    if first is None and not ids_equal:
        first = min(len(got.ids), len(recorded.ids))  # one is the other cut short
    beyond = next((i for i, d in enumerate(deltas) if d > tolerance), None)
    if beyond is not None and (first is None or beyond < first):
        first = beyond
    return TokenCheck(
        oracle="tokens", tokens=len(recorded.ids), ids_equal=ids_equal, max_abs_logprob_delta=worst, tolerance=tolerance, first_mismatch=first,
    )  # fmt: skip


def judge(validation: Validation, captured: CapturedValidation, spec: ValidationSpec) -> Validation:
    """*validation* (the text compared) with the token check added and ``passed`` made to hold both."""
    if captured.tokens is None:
        check = TokenCheck(oracle="text", note=NO_RECORD)
    elif (spec.prompt, spec.max_tokens) != (captured.prompt, captured.max_tokens):
        check = TokenCheck(oracle="text", note=OTHER_REQUEST)
    else:
        check = compare(captured.tokens, validation.tokens, spec.logprob_tolerance)
    return validation.model_copy(update={"token_check": check, "passed": validation.passed and check.passed})


def refusal(validation: Validation, *, replied: str, ref: str, where: str) -> ValidationError:
    """The one-line error for a restore whose reply *validation* did not pass."""
    check = validation.token_check
    if validation.reply != validation.expected_reply or check is None or check.passed:
        return ValidationError("%s replied %r, capsule %s recorded %r: the capsule does not match %s; recapture" % (replied, validation.reply, ref, validation.expected_reply, where))
    if validation.tokens is None:
        return ValidationError(
            "%s replied %r as recorded but returned no token ids and log-probabilities, which capsule %s recorded: the engine is not the one captured; recapture" % (replied, validation.reply, ref),
            code="validation.tokens",
        )
    if not check.ids_equal:
        return ValidationError(
            "%s replied %r as recorded, in other tokens than capsule %s recorded (the first differs at token %s): the capsule does not match %s; recapture" % (replied, validation.reply, ref, check.first_mismatch, where),
            code="validation.tokens",
        )
    return ValidationError(
        "%s replied %r in the recorded tokens, but their log-probabilities differ from capsule %s's by up to %.3g (tolerance %g, first beyond it at token %s): "
        "the engine computes other numbers than the one captured; recapture, or raise coldsnap.validation.logprob_tolerance where this host's arithmetic is known to differ"
        % (replied, validation.reply, ref, check.max_abs_logprob_delta or 0.0, check.tolerance or 0.0, check.first_mismatch),
        code="validation.logprobs",
    )
