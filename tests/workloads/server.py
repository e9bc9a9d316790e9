"""A small multi-process server for exercising CRIU for real (not an engine).

It has what matters to a checkpoint of an inference server: an HTTP listener,
worker processes started with the spawn method (named semaphores), a named
shared-memory ring the workers write, and output to a file. Options add an
io_uring instance or a TCP connection to an outside peer, which capture must
refuse, or a TCP connection between two of its own processes, which CRIU
restores (``--tcp-established``). With ``--fake-cuda`` the server and its worker
each hold a FAKE CUDA context (tests/fakes/fake_cuda), and requests run as kernels.

GET /state answers with the counter the workers keep in shared memory; GET /tcp
with a number the inside peer sends back over that connection, one more each time.
"""

import argparse
import contextlib
import ctypes
import http.server
import multiprocessing as mp
import signal
import socket
import sys
from multiprocessing import shared_memory


def no_gpu():
    return contextlib.nullcontext()


def worker(shm_name, lock, pipe, fake_cuda=False):
    shm = shared_memory.SharedMemory(name=shm_name)
    kernel = attach_fake_cuda().kernel if fake_cuda else no_gpu
    while True:
        msg = pipe.recv()
        with lock, kernel():
            value = int.from_bytes(shm.buf[:8], "little") + msg
            shm.buf[:8] = value.to_bytes(8, "little")
        pipe.send(value)


def attach_fake_cuda():
    import fake_cuda_process

    return fake_cuda_process.attach()


def tcp_peer(port):
    """Inside the tree: answers each number the server sends over TCP with the next one."""
    conn = socket.create_connection(("127.0.0.1", port))
    while True:
        data = conn.recv(8)
        if len(data) < 8:
            return
        conn.sendall((int.from_bytes(data, "little") + 1).to_bytes(8, "little"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--io-uring", action="store_true")
    ap.add_argument("--connect", default=None, help="host:port to keep a TCP connection to")
    ap.add_argument("--inside-tcp", action="store_true", help="keep a TCP connection to a process of its own")
    ap.add_argument("--fake-cuda", action="store_true", help="hold a FAKE CUDA context in the server and its worker")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    shm = shared_memory.SharedMemory(create=True, size=4 << 20)
    lock = ctx.Lock()
    parent, child = ctx.Pipe()
    w = ctx.Process(target=worker, args=(shm.name, lock, child, args.fake_cuda), daemon=True)
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
    inside = None
    if args.inside_tcp:
        listener = socket.create_server(("127.0.0.1", 0))
        ctx.Process(target=tcp_peer, args=(listener.getsockname()[1],), daemon=True).start()
        inside, _ = listener.accept()
        listener.close()  # only the established pair is left
    counter = [0]
    kernel = attach_fake_cuda().kernel if args.fake_cuda else no_gpu

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/slow":
                with kernel(3.0):  # a long kernel: a lock waits for it
                    body = b"slow\n"
            elif self.path == "/tcp" and inside is not None:
                inside.sendall(counter[0].to_bytes(8, "little"))
                counter[0] = int.from_bytes(inside.recv(8), "little")
                body = ("%d\n" % counter[0]).encode()
            else:
                with kernel():
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
