"""A small multi-process server for exercising CRIU for real (not an engine).

It has what matters to a checkpoint of an inference server: an HTTP listener,
worker processes started with the spawn method (named semaphores), a named
shared-memory ring the workers write, and output to a file. Options add an
io_uring instance or a TCP connection to an outside peer, which capture must
refuse.

GET /state answers with the counter the workers keep in shared memory.
"""

import argparse
import ctypes
import http.server
import multiprocessing as mp
import signal
import socket
import sys
from multiprocessing import shared_memory


def worker(shm_name, lock, pipe):
    shm = shared_memory.SharedMemory(name=shm_name)
    while True:
        msg = pipe.recv()
        with lock:
            value = int.from_bytes(shm.buf[:8], "little") + msg
            shm.buf[:8] = value.to_bytes(8, "little")
        pipe.send(value)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--io-uring", action="store_true")
    ap.add_argument("--connect", default=None, help="host:port to keep a TCP connection to")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    shm = shared_memory.SharedMemory(create=True, size=4 << 20)
    lock = ctx.Lock()
    parent, child = ctx.Pipe()
    w = ctx.Process(target=worker, args=(shm.name, lock, child), daemon=True)
    w.start()
    keep = []
    if args.io_uring:
        params = ctypes.create_string_buffer(120)
        fd = ctypes.CDLL(None, use_errno=True).syscall(425, 8, params)
        if fd < 0:
            sys.exit("io_uring_setup failed: errno %d" % ctypes.get_errno())
        keep.append(fd)
    if args.connect:
        host, port = args.connect.rsplit(":", 1)
        keep.append(socket.create_connection((host, int(port))))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            parent.send(1)
            body = ("%d\n" % parent.recv()).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *a):
            print("request", fmt % a, flush=True)

    server = http.server.HTTPServer(("127.0.0.1", args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    print("ready on", args.port, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
