"""FAKE vLLM with tensor parallel across hosts (tests only): one rank per host on FAKE GPUs.

It is started the way sparkrun's ``vllm-distributed`` runtime starts vLLM on each host: the
recipe's serve command plus ``--nnodes N --node-rank R --master-addr HEAD --master-port P``,
and ``--headless`` on every host but the head. What it does is vLLM's multi-node shape, small:

* every host runs one rank: a worker process holding a FAKE CUDA context
  (tests/fakes/fake_cuda, the host's own ``FAKE_CUDA_DIR``) on the first GPU it sees; the
  head's root process serves the OpenAI and sleep-mode API (the routes of ``fake_vllm.py``)
  and holds a context of its own, as vLLM's API server does;
* the head listens on the master port; every rank's worker connects there (its control
  channel, vLLM's message queue from the engine core to the workers) and says where its
  collective socket listens; once all N are in, each rank connects to its successor: a ring of
  TCP connections between the hosts, as NCCL's socket transport makes (the ring's interface
  is the one the rank advertises, ``NODE_IP``, as ``NCCL_SOCKET_IFNAME`` picks one);
* the ring is the tensor-parallel group's NCCL communicator (``tp:0``): each rank's context
  holds it from the start (``hold_communicator``), so where the fake driver loses kept
  communicators (``FAKE_CUDA_KEPT_COMMUNICATORS=break``) a CUDA checkpoint of a rank that still
  holds it breaks the rank's context, and its next kernel after the restore fails with
  "unspecified launch failure" (tests/fakes/fake_cuda);
* a generation is a ring all-reduce: each rank computes its share inside a kernel of its
  context (a kernel waits while the process is CUDA-locked, and fails without a device), the
  partial sums go once around the ring, every rank must reach the same sum, and the reply is a
  deterministic function of that sum and the prompt: a rank with the wrong weights changes it;
* ``POST /sleep?level=2`` releases weights and KV cache on every rank; ``/wake_up?tags=...``
  maps them again; weights woken after a level-2 sleep are garbage until ``reload_weights`` or
  ``coldsnap_load_native`` fills them; work on released memory ends the rank (an illegal
  memory access), and a rank that ends takes the server with it;
* ``POST /collective_rpc`` reaches every rank: ``reload_weights`` (each re-reads the model
  files), ``coldsnap_export_native`` (each writes ``DIR/rank-N.bin`` and ``rank-N.json`` on its
  own host), ``coldsnap_load_native`` (each reads its own back, and refuses a file it did not
  write), ``coldsnap_detach_communicators`` (each closes its ring and holds no communicator:
  ``{"rank", "detached": ["tp:0"], "torch_nccl_initialized": []}``; a generation on a
  detached rank ends it, as the destroyed communicator's
  stand-in refuses), ``coldsnap_attach_communicators`` (collective: each rank listens on a new
  ring port, the head gathers the addresses over the engine core's channel, which stands for
  vLLM's gloo CPU group, and hands out the table, each rank connects to its successor and
  accepts its predecessor and holds the communicator again: ``{"rank", "attached": ["tp:0"],
  "seconds"}``; on ranks that detached nothing it makes nothing, ``"attached": []``, as the
  plugin's extension does, and a second detach is refused, 500); ``{"results": [one per
  rank]}``; a method the workers lack answers 400, as vLLM does: the workers have
  ``reload_weights``, the native payload's methods with ``--worker-extension-cls
  coldsnap_native_weights.NativeWeights`` or ``coldsnap_worker.ColdsnapWorker``, and the
  communicators' with the latter only;
* arguments parsed strictly: a flag vLLM does not have stops it at start.

Every call the head serves is logged on stdout as ``fake-vllm call: {"method", "path"}`` (and
``"rpc"``, the method a ``/collective_rpc`` asked of the workers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "fake_cuda")]  # the engine's own PYTHONPATH is the recipe's
import fake_cuda_process  # noqa: E402
from fake_sglang import WORDS, weights_digest  # noqa: E402
from openai_http import JsonHandler  # noqa: E402

TAGS = ("weights", "kv_cache")
MASK = (1 << 62) - 1
#: the one NCCL communicator of a dense tensor-parallel vLLM worker: its TP group's
GROUP = "tp:0"
NATIVE = ("coldsnap_export_native", "coldsnap_load_native")
COMMUNICATORS = ("coldsnap_detach_communicators", "coldsnap_attach_communicators")
#: what each worker extension class adds to the workers' methods (a class of the recipe's own
#: adds none of coldsnap's)
EXTENSIONS = {"coldsnap_native_weights.NativeWeights": NATIVE, "coldsnap_worker.ColdsnapWorker": NATIVE + COMMUNICATORS}
#: what each worker call is on the GPU: kernels, or memory mapped and copied (no kernel), which
#: a context broken by a kept communicator still carries out
KERNELS = ("generate", "coldsnap_attach_communicators")  # NCCL's init ends with a warm-up all-reduce


def die(who: str, why: str) -> None:
    print("%s hit an exception: %s" % (who, why), flush=True)
    os._exit(1)


def model_dir(model: str, revision: str | None) -> str:
    """The snapshot a model id names in the Hugging Face cache (vLLM resolves it the same way offline)."""
    if os.path.isdir(model):
        return model
    hub = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"
    snapshots = hub / ("models--%s" % model.replace("/", "--")) / "snapshots"
    chosen = snapshots / revision if revision else next(iter(sorted(snapshots.glob("*"))), snapshots)
    if not chosen.is_dir():
        die("EngineCore", "model %s@%s is not in the cache (%s)" % (model, revision, chosen))
    return str(chosen)


def send_line(conn: socket.socket, doc: dict) -> None:
    conn.sendall(json.dumps(doc).encode() + b"\n")


class Lines:
    """JSON documents, one per line, read from a connection."""

    def __init__(self, conn: socket.socket) -> None:
        self.file = conn.makefile("rb")

    def read(self) -> dict:
        line = self.file.readline()
        if not line:
            raise ConnectionError("peer went away")
        return json.loads(line)


def send_int(conn: socket.socket, value: int) -> None:
    conn.sendall(struct.pack("<q", value))


def recv_int(conn: socket.socket) -> int:
    data = b""
    while len(data) < 8:
        chunk = conn.recv(8 - len(data))
        if not chunk:
            raise ConnectionError("ring peer went away")
        data += chunk
    return struct.unpack("<q", data)[0]


# -- a rank: the worker process on each host ---------------------------------------------


class Rank:
    def __init__(self, args) -> None:
        self.rank, self.world = args.node_rank, args.nnodes
        self.model = model_dir(args.model, args.revision)
        self.ctx = fake_cuda_process.attach(0)
        self.asleep: set[str] = set()
        self.loaded = True  # False: the weights' memory was woken empty after a level-2 sleep
        self.digest = self._digest()
        self.address = os.environ.get("NODE_IP") or "127.0.0.1"
        ring = socket.create_server((self.address, 0))
        control = _connect(args.master_addr, args.master_port)
        send_line(control, {"rank": self.rank, "ring": [self.address, ring.getsockname()[1]], "pid": os.getpid()})
        self.control, self.lines = control, Lines(control)
        self.succ: socket.socket | None = None
        self.pred: socket.socket | None = None
        self._join_ring(ring, self.lines.read()["table"])
        send_line(control, {"ready": self.rank})

    def _join_ring(self, listener: socket.socket, table: list) -> None:
        """Connect to the successor, accept the predecessor: the communicator, held from here on."""
        succ_host, succ_port = table[(self.rank + 1) % self.world]
        self.succ = _connect(succ_host, succ_port)
        self.pred, _ = listener.accept()
        listener.close()
        self.ctx.hold_communicator(True)

    def _digest(self) -> str:
        whole = weights_digest(self.model)
        if whole is None:
            die("Worker", "no *.safetensors under %s" % self.model)
        return hashlib.sha256(("%s rank %d" % (whole, self.rank)).encode()).hexdigest()

    def serve(self) -> None:
        while True:
            try:
                req = self.lines.read()
            except (ConnectionError, OSError) as err:
                print("Worker rank %d: the engine core's channel ended (%r): exiting" % (self.rank, err), flush=True)
                return
            work = self.ctx.kernel if req["op"] in KERNELS else self.ctx.transfer
            try:
                with work():  # every step of a worker is GPU work
                    answer = getattr(self, "op_" + req["op"])(req)
            except fake_cuda_process.CudaError as err:
                die("Worker rank %d" % self.rank, str(err))
            send_line(self.control, {"ok": True, "result": answer})

    def _touch(self, what: str) -> None:
        if what in self.asleep:
            die("Worker rank %d" % self.rank, "CUDA error: an illegal memory access was encountered (%s used while released)" % what)

    def op_generate(self, req: dict) -> int:
        self._touch("weights")
        self._touch("kv_cache")
        if self.succ is None or self.pred is None:
            die("Worker rank %d" % self.rank, "RuntimeError: the NCCL communicator of group %s was destroyed (coldsnap_detach_communicators): no collective until coldsnap_attach_communicators" % GROUP)
        seed = self.digest if self.loaded else "garbage"
        mine = int.from_bytes(hashlib.sha256((seed + req["prompt"]).encode()).digest()[:8], "little") & MASK
        total, passing = mine, mine
        for _ in range(self.world - 1):  # ring all-reduce: after world - 1 steps every rank has every share
            send_int(self.succ, passing)
            passing = recv_int(self.pred)
            total = (total + passing) & MASK
        return total

    def op_coldsnap_detach_communicators(self, req: dict) -> dict:
        if self.succ is None or self.pred is None:  # the extension refuses a second detach
            return {"error": "rank %d's communicators are already detached (%s)" % (self.rank, GROUP)}
        self.succ.close()
        self.pred.close()
        self.succ = self.pred = None
        self.ctx.hold_communicator(False)
        return {"rank": self.rank, "detached": [GROUP], "torch_nccl_initialized": []}

    def op_coldsnap_attach_communicators(self, req: dict) -> dict:
        """The collective half over the engine core's channel: offer a ring address, take the table."""
        started = time.monotonic()
        if self.succ is not None:  # nothing detached: the extension makes nothing
            send_line(self.control, {"ring": None})
            self.lines.read()  # the head's answer, which is no table
            return {"rank": self.rank, "attached": [], "seconds": time.monotonic() - started}
        listener = socket.create_server((self.address, 0))
        send_line(self.control, {"ring": [self.address, listener.getsockname()[1]]})
        table = self.lines.read()["table"]
        if table is None:
            listener.close()
            return {"error": "rank %d: another rank had nothing to attach; this one stays detached" % self.rank}
        self._join_ring(listener, table)
        return {"rank": self.rank, "attached": [GROUP], "seconds": time.monotonic() - started}

    def op_sleep(self, req: dict) -> None:
        self.asleep = set(TAGS)
        self.loaded = req["level"] == 1

    def op_wake(self, req: dict) -> None:
        for tag in req["tags"] or TAGS:
            self.asleep.discard(tag)

    def op_reload_weights(self, req: dict) -> dict:
        self._touch("weights")
        self.digest, self.loaded = self._digest(), True
        return {"rank": self.rank}

    def _payload(self) -> bytes:
        return ("fake tensors of rank %d: %s" % (self.rank, self._digest())).encode()

    def op_coldsnap_export_native(self, req: dict) -> dict:
        self._touch("weights")
        directory = Path(req["args"][0])
        data = self._payload()
        (directory / ("rank-%d.bin" % self.rank)).write_bytes(data)
        (directory / ("rank-%d.json" % self.rank)).write_text(json.dumps({"format": "fake", "rank": self.rank, "bytes": len(data)}))
        return {"rank": self.rank, "bytes": len(data), "host": socket.gethostname()}

    def op_coldsnap_load_native(self, req: dict) -> dict:
        self._touch("weights")
        path = Path(req["args"][0]) / ("rank-%d.bin" % self.rank)
        if not path.is_file() or path.read_bytes() != self._payload():
            return {"error": "%s is not the payload rank %d wrote" % (path, self.rank)}
        self.digest, self.loaded = self._digest(), True
        return {"rank": self.rank, "bytes": path.stat().st_size}


def _connect(host: str, port: int, timeout: float = 120.0) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=10)
            conn.settimeout(None)  # a rank waits as long as its peers take (a capture's cut, a restore)
            return conn
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def worker_main(args) -> None:
    Rank(args).serve()
    os._exit(0)


# -- the head: the API server, and the engine core's channel to every rank ---------------


class Engine:
    def __init__(self, args, listener: socket.socket) -> None:
        self.args = args
        self.lock = threading.Lock()
        conns: dict[int, socket.socket] = {}
        hello: dict[int, dict] = {}
        while len(conns) < args.nnodes:
            conn, _ = listener.accept()
            doc = Lines(conn).read()
            conns[doc["rank"]], hello[doc["rank"]] = conn, doc
        self.ranks = [(conns[r], Lines(conns[r])) for r in range(args.nnodes)]
        for conn, _ in self.ranks:
            send_line(conn, {"table": [hello[r]["ring"] for r in range(args.nnodes)]})
        for _, lines in self.ranks:
            lines.read()  # ready

    def every(self, req: dict) -> list:
        """*req* on every rank at once; their answers, in rank order."""
        for conn, _ in self.ranks:
            send_line(conn, req)
        return [doc["result"] for doc in self._gather()]

    def _gather(self) -> list[dict]:
        """One line from every rank, in rank order; a rank gone ends the engine."""
        out = []
        for r, (_, lines) in enumerate(self.ranks):
            try:
                out.append(lines.read())
            except (ConnectionError, OSError):
                die("EngineCore", "worker rank %d died" % r)
        return out

    def attach(self, req: dict) -> list:
        """``coldsnap_attach_communicators``: every rank's ring address gathered over the CPU
        channel and the table handed back (vLLM's unique id broadcast over gloo), then the answers;
        the table is withheld from all when one rank refuses."""
        for conn, _ in self.ranks:
            send_line(conn, req)
        offers = [doc["ring"] for doc in self._gather()]
        table = offers if all(offers) else None
        for conn, _ in self.ranks:
            send_line(conn, {"table": table})
        return [doc["result"] for doc in self._gather()]


def make_handler(engine: Engine, api_ctx, served: str):
    dev = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"

    class Handler(JsonHandler):
        def do_GET(self):
            print("fake-vllm call: %s" % json.dumps({"method": "GET", "path": self.path}), flush=True)
            path = urlsplit(self.path).path
            if path == "/health":
                return self._send(200)
            if path == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": served, "object": "model", "owned_by": "vllm"}]})
            self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            parts = urlsplit(self.path)
            query = parse_qs(parts.query)
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else {}
            rpc = {"rpc": body.get("method")} if parts.path == "/collective_rpc" else {}
            print("fake-vllm call: %s" % json.dumps({"method": "POST", "path": self.path, **rpc}), flush=True)
            with engine.lock, api_ctx.kernel():
                if parts.path == "/v1/chat/completions":
                    return self._chat(body)
                if not dev or parts.path not in ("/sleep", "/wake_up", "/collective_rpc"):
                    return self._send(404, {"detail": "Not Found"})
                if parts.path == "/sleep":
                    if not engine.args.enable_sleep_mode:
                        return self._send(500, {"error": {"message": "Sleep mode is not enabled in the model config", "code": 500}})
                    engine.every({"op": "sleep", "level": int((query.get("level") or ["1"])[0])})
                    return self._send(200)
                if parts.path == "/wake_up":
                    engine.every({"op": "wake", "tags": query.get("tags") or []})
                    return self._send(200)
                method = body.get("method")
                extension = engine.args.worker_extension_cls
                if method not in ("reload_weights", *EXTENSIONS.get(extension or "", ())):
                    lacking = "--worker-extension-cls %s" % extension if extension else "no --worker-extension-cls"
                    return self._send(400, {"error": {"message": "Method %r not found in the workers (%s)" % (method, lacking), "code": 400}})
                call = {"op": method, "args": body.get("args") or []}
                results = engine.attach(call) if method == "coldsnap_attach_communicators" else engine.every(call)
                failed = [r["error"] for r in results if isinstance(r, dict) and "error" in r]
                if failed:
                    return self._send(500, {"error": {"message": failed[0], "code": 500}})
                return self._send(200, {"results": results})

        def _chat(self, req: dict) -> None:
            prompt = str((req.get("messages") or [{}])[-1].get("content", ""))
            sums = set(engine.every({"op": "generate", "prompt": prompt}))
            if len(sums) != 1:
                return self._send(500, {"error": {"message": "ranks disagree: %s" % sorted(sums), "code": 500}})
            seed = hashlib.sha256(("%d %s" % (sums.pop(), prompt)).encode()).digest()
            words = [" " + WORDS[seed[i % len(seed)] % len(WORDS)] for i in range(int(req.get("max_tokens") or 16))]
            self._send_chat(req, words)

    return Handler


def watch(worker: subprocess.Popen) -> None:
    """The host's rank ends: so does this process (vLLM's launcher and API server do)."""
    code = worker.wait()
    die("EngineCore", "the rank on this host exited (%s)" % code)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="FAKE vLLM across hosts (tests only)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--revision", default=None)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=29501)
    ap.add_argument("--headless", action="store_true")
    ap.add_argument("--enable-sleep-mode", action="store_true")
    ap.add_argument("--worker-extension-cls", default=None)
    ap.add_argument("--disable-custom-all-reduce", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true")  # no CUDA graphs to hold the communicator
    ap.add_argument("--distributed-executor-backend", default="mp")
    ap.add_argument("--fake-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tensor_parallel_size != args.nnodes:
        ap.error("this fake runs one rank per node: --tensor-parallel-size %d with --nnodes %d" % (args.tensor_parallel_size, args.nnodes))
    return args


def main() -> None:
    args = parse_args()
    if args.fake_worker:
        return worker_main(args)
    listener = None
    if not args.headless:
        # The engine core's rendezvous, bound before anything else (sparkrun waits for it).
        listener = socket.create_server(("0.0.0.0", args.master_port))
    worker = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--fake-worker"])
    threading.Thread(target=watch, args=(worker,), daemon=True).start()
    if listener is None:
        while True:
            time.sleep(3600)
    api_ctx = fake_cuda_process.attach(0)  # vLLM's API server holds a context too
    engine = Engine(args, listener)
    listener.close()
    served = args.served_model_name or args.model
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine, api_ctx, served))
    print("fake-vllm: rank 0 of %d serving %s on %s:%d" % (args.nnodes, served, args.host, args.port), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
