"""The token oracle's parts without an engine: the stream's token record (chunks shaped as CPU vLLM
0.32 streams them when asked for ``logprobs`` and ``return_token_ids``, taken from a real reply),
the comparison, the refusals and their codes, and documents written before the record existed.
The whole oracle against the real engine is in tests/test_engine_cycle.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sparkrun_coldsnap.controller import oracle
from sparkrun_coldsnap.documents.capsule_config import CapturedValidation
from sparkrun_coldsnap.documents.receipts import Validation
from sparkrun_coldsnap.documents.request import ValidationSpec
from sparkrun_coldsnap.documents.tokens import DEFAULT_LOGPROB_TOLERANCE, TokenRecord
from sparkrun_coldsnap.engines.openai_stream import stream_chat
from sparkrun_coldsnap.engines.vllm import VllmAdapter

IDS = (545, 281, 592)
LOGPROBS = (-5.6356916427612305, -5.662346363067627, -5.5100202560424805)
WORDS = ("art", "st", "ipt")


def vllm_chunks(with_tokens: bool) -> list[dict]:
    first = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}], "prompt_token_ids": [1, 87, 85]}
    out = [first]
    for i, lp, w in zip(IDS, LOGPROBS, WORDS, strict=True):
        choice: dict = {"index": 0, "delta": {"content": w}, "logprobs": None, "finish_reason": None}
        if with_tokens:
            choice["logprobs"] = {"content": [{"token": w, "logprob": lp, "bytes": list(w.encode()), "top_logprobs": [{"token": w, "logprob": lp, "bytes": list(w.encode())}]}]}
            choice["token_ids"] = [i]
        out.append({"object": "chat.completion.chunk", "choices": [choice]})
    return out


@pytest.fixture
def server() -> Iterator[tuple[str, list[dict]]]:
    """An OpenAI-shaped endpoint that streams the recorded chunks, with token fields only when asked."""
    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for chunk in vllm_chunks(bool(body.get("logprobs") and body.get("return_token_ids"))):
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield "http://127.0.0.1:%d" % httpd.server_address[1], bodies
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_adapter_asks_for_the_tokens_and_the_stream_keeps_their_ids_and_log_probabilities(server):
    url, bodies = server
    reply = stream_chat(url, "m", "hi", max_tokens=3, timeout=10, extra=VllmAdapter.token_fields)
    assert bodies[-1]["logprobs"] is True and bodies[-1]["top_logprobs"] == 1 and bodies[-1]["return_token_ids"] is True
    assert bodies[-1]["stream"] is True and bodies[-1]["temperature"] == 0
    assert reply.text == "artstipt" and reply.first_token_at is not None
    assert reply.has_tokens and reply.token_ids == IDS and reply.logprobs == LOGPROBS


def test_an_engine_that_ignores_the_fields_answers_without_a_record(server):
    url, _ = server
    reply = stream_chat(url, "m", "hi", max_tokens=3, timeout=10)
    assert reply.text == "artstipt" and not reply.has_tokens and reply.token_ids == () and reply.logprobs == ()


def captured(tokens: TokenRecord | None = TokenRecord(ids=IDS, logprobs=LOGPROBS)) -> CapturedValidation:
    return CapturedValidation(prompt="hi", max_tokens=3, reply="artstipt", tokens=tokens)


def restored(ids=IDS, logprobs=LOGPROBS, reply="artstipt") -> Validation:
    tokens = TokenRecord(ids=ids, logprobs=logprobs) if ids else None
    return Validation(passed=reply == "artstipt", reply=reply, expected_reply="artstipt", ttft_seconds=0.5, tokens=tokens)


def test_the_same_ids_and_log_probabilities_pass_and_the_receipt_says_by_how_much():
    shifted = tuple(x + 4e-4 for x in LOGPROBS)
    v = oracle.judge(restored(logprobs=shifted), captured(), ValidationSpec(prompt="hi", max_tokens=3))
    check = v.token_check
    assert v.passed and check is not None and check.oracle == "tokens" and check.tokens == 3 and check.ids_equal
    assert check.max_abs_logprob_delta == pytest.approx(4e-4) and check.tolerance == DEFAULT_LOGPROB_TOLERANCE and check.first_mismatch is None
    assert v.ttft_seconds == 0.5  # the streamed first-token timing is kept


def test_the_same_text_with_one_log_probability_changed_fails_with_its_own_code():
    perturbed = (LOGPROBS[0], LOGPROBS[1] + 0.01, LOGPROBS[2])
    v = oracle.judge(restored(logprobs=perturbed), captured(), ValidationSpec(prompt="hi", max_tokens=3))
    assert not v.passed and v.reply == v.expected_reply
    assert v.token_check is not None and v.token_check.ids_equal and v.token_check.first_mismatch == 1
    assert v.token_check.max_abs_logprob_delta == pytest.approx(0.01)
    err = oracle.refusal(v, replied="the restored workload", ref="tiny:latest", where="this host")
    assert err.code == "validation.logprobs" and "log-probabilities differ" in err.message and "token 1" in err.message and "logprob_tolerance" in err.message
    # A tolerance the recipe raises lets the same difference pass.
    assert oracle.judge(restored(logprobs=perturbed), captured(), ValidationSpec(prompt="hi", max_tokens=3, logprob_tolerance=0.05)).passed


def test_the_same_text_in_other_tokens_or_with_none_fails_as_other_tokens():
    v = oracle.judge(restored(ids=(545, 281, 593)), captured(), ValidationSpec(prompt="hi", max_tokens=3))
    assert not v.passed and v.token_check is not None and v.token_check.ids_equal is False and v.token_check.first_mismatch == 2
    assert oracle.refusal(v, replied="r", ref="c", where="w").code == "validation.tokens"
    none = oracle.judge(restored(ids=()), captured(), ValidationSpec(prompt="hi", max_tokens=3))
    assert not none.passed and oracle.refusal(none, replied="r", ref="c", where="w").code == "validation.tokens"


def test_other_text_fails_as_before():
    v = oracle.judge(restored(reply="other"), captured(), ValidationSpec(prompt="hi", max_tokens=3))
    err = oracle.refusal(v, replied="the restored workload", ref="tiny:latest", where="this host")
    assert not v.passed and err.code == "validation.failed" and "replied 'other'" in err.message


def test_without_a_record_or_for_another_prompt_the_text_alone_is_compared_and_the_receipt_says_so():
    v = oracle.judge(restored(), captured(tokens=None), ValidationSpec(prompt="hi", max_tokens=3))
    assert v.passed and v.token_check is not None and v.token_check.oracle == "text" and "recorded no tokens" in (v.token_check.note or "")
    other = oracle.judge(restored(), captured(), ValidationSpec(prompt="hi", max_tokens=4))
    assert other.passed and other.token_check is not None and other.token_check.oracle == "text" and "max_tokens" in (other.token_check.note or "")


def test_documents_written_before_the_record_read_and_write_back_unchanged():
    old_config = {"prompt": "hi", "max_tokens": 3, "reply": "artstipt", "request_ttft_seconds": None}
    assert CapturedValidation.model_validate(old_config).model_dump(mode="json") == old_config
    old_spec = {"prompt": "hi", "expected_reply": None, "max_tokens": 16, "timeout_seconds": 120.0}
    assert ValidationSpec.model_validate(old_spec).model_dump(mode="json") == old_spec  # the request's digest is unchanged
    assert ValidationSpec(prompt="hi", logprob_tolerance=0.01).model_dump(mode="json")["logprob_tolerance"] == 0.01
    with pytest.raises(ValueError, match="2 token ids but 3 log-probabilities"):
        TokenRecord(ids=(1, 2), logprobs=(-1.0, -2.0, -3.0))
