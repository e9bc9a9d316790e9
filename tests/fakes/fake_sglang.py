"""FAKE SGLang server: the HTTP API of ``sglang.launch_server`` (0.5.17), without a model.

SGLang cannot run on the CPU machines CI uses (no CPU build of its kernels), so
the adapter is tested against this fake. It answers the same paths with the
same bodies, status codes and streaming format as the real server, and it is no
kinder than the real one:

* three processes, as the real server: this one serves HTTP (SGLang's tokenizer
  manager), a scheduler holds the weights and the memory, a detokenizer turns the
  scheduler's tokens into text; when the scheduler or the detokenizer dies the
  server exits, as the real one does; with ``FAKE_CUDA_DIR`` set the scheduler holds a
  FAKE CUDA context (tests/fakes/fake_cuda), so the GPU drivers' steps run against it;
* its arguments are parsed strictly: a flag SGLang does not have stops it at start
  (the ``--fake-*`` ones are the fake's own);
* ``GET /health``: empty body; 503 while starting; then, as the real one, it generates
  one token through the scheduler before answering 200 (``--fake-health-seconds``, so a
  client that gives it two seconds waits forever); 503 while weights or KV cache are
  released;
* ``GET /v1/models``: ``{"object": "list", "data": [{"id": served name, ...}]}``;
* ``POST /generate`` (SGLang's own API): ``{"text": ..., "sampling_params":
  {"max_new_tokens": n}}`` -> ``{"text": ..., "meta_info": {...}}``;
* ``POST /v1/chat/completions``: the model name is not checked; with
  ``stream`` the events are ``data: <json>\\n\\n``: a role chunk
  (``{"reasoning_content": null, "role": "assistant", "content": ""}``), content
  chunks, a finish chunk, then ``data: [DONE]``; errors are
  ``{"object": "error", "message": ..., "type": ..., "param": null, "code": 400}``;
* ``POST /release_memory_occupation`` / ``/resume_memory_occupation`` with
  ``{"tags": [...]}`` (``weights``, ``kv_cache``, ``cuda_graph``; none means all):
  200 with ``null``; released tags are tracked with or without
  ``--enable-memory-saver``; resuming a tag that was not released kills the server
  (the real scheduler raises). Released weights are dropped, not kept, unless
  ``--enable-weights-cpu-backup``: after resuming ``weights`` without
  ``/update_weights_from_disk`` the real server (0.5.17 on an H200) answered every
  request with empty text, and so does this one;
* work that touches released memory (a generation while weights or KV cache are
  released, a weights reload while the weights' memory is released) is what the real
  scheduler dies on (an illegal memory access on unmapped device memory): the fake's
  scheduler exits and takes the server with it;
* ``POST /update_weights_from_disk`` ``{"model_path": ...}``: 200
  ``{"success": true, "message": "Succeeded to update model weights.", "num_paused_requests": 0}``,
  400 with ``success: false`` when the path has no weights; on success the served
  name becomes the path. It takes ``--fake-reload-seconds``.

Every call is logged on stdout as ``fake-sglang call: {"method", "path", "body"}``
so tests can check what a client asked, in order.

The reply is a deterministic function of the weights files' bytes and the
prompt, so a restore that brought back the wrong weights answers differently.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import wait
from pathlib import Path

ALL_TAGS = ("kv_cache", "weights", "cuda_graph")
WORDS = ["cold", "start", "capsule", "restore", "token", "warm", "graph", "kernel", "weights", "ready"]


def weights_digest(path: str) -> str | None:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.read_bytes())
    return h.hexdigest()


def die(why: str) -> None:
    print("Scheduler hit an exception: %s" % why, flush=True)
    os._exit(1)


def gpu_context():
    """The scheduler's CUDA context: a FAKE one (tests/fakes/fake_cuda) when ``FAKE_CUDA_DIR`` is
    set, so the GPU drivers' steps (lock, checkpoint, restore, unlock) act on it; none otherwise."""
    if not os.environ.get("FAKE_CUDA_DIR"):
        return contextlib.nullcontext
    import fake_cuda_process

    return fake_cuda_process.attach().kernel


def scheduler(requests, tokens, model_path: str, cpu_backup: bool, reload_seconds: float, token_seconds: float) -> None:
    """Holds the weights and the device memory; answers each request with token ids (or a status)."""
    digest = weights_digest(model_path)
    if digest is None:
        die("no *.safetensors under %s" % model_path)
    kernel = gpu_context()
    released: set[str] = set()
    loaded = True  # False once the weights' memory was released without a CPU backup
    while True:
        try:
            op, arg = requests.recv()
        except EOFError:
            return
        with kernel():  # every scheduler step is GPU work
            if op == "generate":
                prompt, n = arg
                if released & {"weights", "kv_cache"}:
                    die("CUDA error: an illegal memory access was encountered (generation with %s released)" % sorted(released))
                time.sleep(token_seconds * n)
                seed = hashlib.sha256((digest + prompt).encode()).digest()
                ids = [seed[i % len(seed)] % len(WORDS) if loaded else -1 for i in range(n)]
                tokens.send(("tokens", ids))
            elif op == "release":
                released |= set(arg)
                if "weights" in arg and not cpu_backup:
                    loaded = False
                tokens.send(("status", None))
            elif op == "resume":
                if not set(arg) <= released:
                    die("KeyError %s" % sorted(set(arg) - released))
                released -= set(arg)
                tokens.send(("status", None))
            elif op == "update":
                if "weights" in released:
                    die("CUDA error: an illegal memory access was encountered (weights loaded into released memory)")
                new = weights_digest(arg) if Path(arg).is_dir() else None
                if new is None:
                    tokens.send(("status", {"success": False, "message": "Failed to get weights iterator: %s not found." % arg, "num_paused_requests": 0}))
                    continue
                time.sleep(reload_seconds)
                digest, loaded = new, True
                tokens.send(("status", {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}))
            elif op == "released":
                tokens.send(("status", sorted(released)))


def detokenizer(tokens, out) -> None:
    """Token ids to text (a dropped weight gives empty text), status answers passed through."""
    while True:
        try:
            kind, value = tokens.recv()
        except EOFError:
            return
        if kind == "tokens":
            out.send(("text", ["" if i < 0 else " " + WORDS[i] for i in value]))
        else:
            out.send((kind, value))


class Engine:
    """The HTTP process's side of the scheduler and detokenizer: one request at a time."""

    def __init__(self, args) -> None:
        ctx = mp.get_context("spawn")
        req_recv, self.req_send = ctx.Pipe(duplex=False)
        tok_recv, tok_send = ctx.Pipe(duplex=False)
        self.out_recv, out_send = ctx.Pipe(duplex=False)
        self.procs = [
            ctx.Process(target=scheduler, args=(req_recv, tok_send, args.model_path, args.enable_weights_cpu_backup, args.fake_reload_seconds, args.fake_token_seconds), name="sglang::scheduler"),
            ctx.Process(target=detokenizer, args=(tok_recv, out_send), name="sglang::detokenizer"),
        ]
        for p in self.procs:
            p.start()
        for end in (req_recv, tok_recv, tok_send, out_send):
            end.close()  # the children hold these: a dead child is seen as EOF here
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        wait([p.sentinel for p in self.procs])
        print("fake-sglang: a subprocess died; exiting, as the real server does", flush=True)
        os._exit(1)

    def ask(self, op: str, arg=None):
        with self.lock:
            self.req_send.send((op, arg))
            try:
                return self.out_recv.recv()[1]
            except EOFError:
                os._exit(1)


class State:
    def __init__(self, args) -> None:
        self.served = args.served_model_name or args.model_path
        self.ready_at = time.monotonic() + args.fake_startup_seconds
        self.health_seconds = args.fake_health_seconds
        self.engine = Engine(args)
        #: each cache variable of the environment: "hit" (its kernel was there) or "miss" (compiled)
        self.compiled = compile_kernels() if args.fake_compile_cache else {}


def compile_kernels() -> dict[str, str]:
    """What the real server compiles at start (Inductor, Triton): one FAKE kernel into each of
    those caches the environment names, written only where it is missing."""
    from fake_compiling_engine import compile_into

    return {var: compile_into(os.environ[var]) for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") if os.environ.get(var)}


def make_handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):
            print("fake-sglang:", fmt % a, flush=True)

        def _send(self, status: int, body: bytes = b"", content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, doc) -> None:
            self._send(status, json.dumps(doc).encode())

        def _error(self, status: int, message: str, kind: str = "BadRequest") -> None:
            self._json(status, {"object": "error", "message": message, "type": kind, "param": None, "code": status})

        def _body(self):
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                return json.loads(raw) if raw else None
            except ValueError:
                return "malformed"

        def _log_call(self, body=None) -> None:
            print("fake-sglang call: %s" % json.dumps({"method": self.command, "path": self.path, "body": body}), flush=True)

        def do_GET(self):
            self._log_call()
            if self.path in ("/health", "/health_generate"):
                if time.monotonic() < state.ready_at or set(state.engine.ask("released")) & {"weights", "kv_cache"}:
                    return self._send(503)
                time.sleep(state.health_seconds)  # the real one generates a token first
                state.engine.ask("generate", ("health", 1))
                self._send(200)
            elif self.path == "/fake/compile_cache":
                self._json(200, state.compiled)
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": state.served, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": state.served, "parent": None, "max_model_len": 2048}]})
            else:
                self._error(404, "Not Found", "404")

        def do_POST(self):
            body = self._body()
            self._log_call(body)
            if body == "malformed":
                return self._error(400, "invalid JSON body", "Bad Request")
            if self.path == "/v1/chat/completions":
                return self._chat(body or {})
            if self.path == "/generate":
                body = body or {}
                words = state.engine.ask("generate", (str(body.get("text", "")), int((body.get("sampling_params") or {}).get("max_new_tokens") or 16)))
                return self._json(200, {"text": "".join(words), "meta_info": {"id": hashlib.md5(os.urandom(8)).hexdigest(), "finish_reason": {"type": "length", "length": len(words)}, "prompt_tokens": 8, "completion_tokens": len(words)}})
            if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                if body is None:
                    return self._error(400, "body required", "Bad Request")
                tags = sorted(set(body.get("tags") or ALL_TAGS))
                state.engine.ask("release" if self.path.startswith("/release") else "resume", tags)
                return self._json(200, None)
            if self.path == "/update_weights_from_disk":
                path = (body or {}).get("model_path")
                if not path:
                    return self._json(400, {"success": False, "message": "model_path is required", "num_paused_requests": 0})
                out = state.engine.ask("update", path)
                if out["success"]:
                    state.served = path
                return self._json(200 if out["success"] else 400, out)
            self._error(404, "Not Found", "404")

        def _chat(self, req: dict) -> None:
            if self.headers.get("Content-Type", "").split(";")[0] != "application/json":
                return self._error(400, "Unsupported Media Type: Only 'application/json' is allowed", "Bad Request")
            messages = req.get("messages") or []
            if not messages:
                return self._error(400, "Messages cannot be empty.", "BadRequestError")
            model = req.get("model", "default")
            words = state.engine.ask("generate", (str(messages[-1].get("content", "")), int(req.get("max_tokens") or 16)))
            rid = hashlib.md5(os.urandom(8)).hexdigest()
            created = int(time.time())
            if not req.get("stream"):
                msg = {"role": "assistant", "content": "".join(words), "reasoning_content": None, "tool_calls": None}
                return self._json(200, {"id": rid, "object": "chat.completion", "created": created, "model": model,
                                        "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": "length", "matched_stop": None}],
                                        "usage": {"prompt_tokens": 8, "total_tokens": 8 + len(words), "completion_tokens": len(words)}, "metadata": {"weight_version": "default"}})  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()

            def event(delta, finish=None):
                doc = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [{"index": 0, "delta": {"reasoning_content": None, **delta}, "logprobs": None, "finish_reason": finish, "matched_stop": None}]}  # fmt: skip
                self.wfile.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
                self.wfile.flush()

            event({"role": "assistant", "content": ""})
            for w in words:
                event({"content": w})
            event({}, "length")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="FAKE SGLang server (tests only)")
    # SGLang's own flags that recipes and the adapter use; anything else is refused, as SGLang refuses it.
    ap.add_argument("--model-path", "--model", dest="model_path", required=True)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--revision", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1)
    ap.add_argument("--mem-fraction-static", type=float, default=None)
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--enable-memory-saver", action="store_true")
    ap.add_argument("--disable-custom-all-reduce", action="store_true")
    ap.add_argument("--enable-symm-mem", action="store_true")
    ap.add_argument("--enable-nccl-nvls", action="store_true")
    ap.add_argument("--enable-weights-cpu-backup", action="store_true")
    ap.add_argument("--log-level", default="info")
    # The fake's own.
    ap.add_argument("--fake-startup-seconds", type=float, default=1.0, help="how long /health answers 503")
    ap.add_argument("--fake-health-seconds", type=float, default=2.5, help="how long /health takes once up (the real one generates a token)")
    ap.add_argument("--fake-reload-seconds", type=float, default=0.2, help="how long /update_weights_from_disk takes")
    ap.add_argument("--fake-compile-cache", action="store_true", help="compile FAKE kernels into the cache directories the environment names (GET /fake/compile_cache: hit or miss)")
    ap.add_argument("--fake-token-seconds", type=float, default=0.0, help="time per generated token")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    state = State(args)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    print("fake-sglang: serving %s on %s:%d" % (args.model_path, args.host, args.port), flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
