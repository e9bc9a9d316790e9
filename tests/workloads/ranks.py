"""A small multi-GPU workload shaped like a tensor-parallel engine, on FAKE GPUs (not an engine).

The root process serves HTTP and holds a FAKE CUDA context on the first GPU (vLLM's API
server does too); it spawns one rank per GPU, each holding a FAKE context on its own GPU
(tests/fakes/fake_cuda), and the ranks form a ring of TCP connections on loopback, as
NCCL's socket transport does with ``NCCL_SOCKET_IFNAME=lo``. ``GET /allreduce`` runs one
ring all-reduce: every rank adds its rank number to the request's value inside a kernel,
then the partial sums travel once around the ring; the root answers with the sum every
rank reached (they must agree). ``GET /state`` counts the all-reduces done. With ``--ipc``
neighbouring ranks also share device memory (CUDA IPC, as NCCL's P2P transport does).

With ``--nccl`` the ring is each rank's NCCL communicator, held in its FAKE context
(``hold_communicator``): kept across a CUDA checkpoint it breaks the rank's context, whose next
kernel fails with "unspecified launch failure" and ends the rank, as on the GPU machine
(tests/fakes/fake_cuda). ``GET /detach`` then destroys it on every rank (each closes its ring;
an all-reduce on a detached rank ends that rank), ``GET /attach`` creates it again (each
rank listens on a new port, the root hands every rank its successor's over its pipe, the
CPU channel that outlives the cut); each answers ``ok``, and ``/attach`` on ranks attached
already answers 500. Without ``--nccl`` the ring is plain sockets that no checkpoint breaks.
"""

import argparse
import http.server
import multiprocessing as mp
import socket
import struct


def attach(device):
    import fake_cuda_process

    return fake_cuda_process.attach(device)


def send_int(conn, value):
    conn.sendall(struct.pack("<q", value))


def recv_int(conn):
    data = b""
    while len(data) < 8:
        chunk = conn.recv(8 - len(data))
        if not chunk:
            raise ConnectionError("ring peer went away")
        data += chunk
    return struct.unpack("<q", data)[0]


def join_ring(pipe):
    """Listen, tell the root where, connect to the successor it names, accept the predecessor."""
    listener = socket.create_server(("127.0.0.1", 0))
    pipe.send(listener.getsockname()[1])
    successor_port = pipe.recv()
    succ = socket.create_connection(("127.0.0.1", successor_port))
    pred, _ = listener.accept()
    listener.close()
    return succ, pred


def rank_main(rank, world, pipe, ipc, nccl):
    import os

    ctx = attach(rank)
    succ, pred = join_ring(pipe)
    ctx.hold_communicator(nccl)
    send_int(succ, os.getpid())
    pred_pid = recv_int(pred)
    if ipc:
        ctx.share_with(pred_pid)  # the predecessor's buffers are mapped here...
        send_int(pred, os.getpid())
        ctx.share_with(recv_int(succ))  # ...and this rank's in its successor
    pipe.send("ready")
    while True:
        value = pipe.recv()
        if value == "detach":
            if succ is not None:
                succ.close()
                pred.close()
            succ = pred = None
            ctx.hold_communicator(False)
            pipe.send("detached")
            continue
        if value == "attach":
            if succ is not None:
                pipe.send("attached already")
                continue
            with ctx.kernel():  # NCCL's init ends with a warm-up all-reduce
                succ, pred = join_ring(pipe)
                ctx.hold_communicator(True)
            pipe.send("attached")
            continue
        if succ is None:
            raise RuntimeError("rank %d: the NCCL communicator was destroyed (/detach): no all-reduce until /attach" % rank)
        with ctx.kernel():
            mine = value + rank
        # Ring all-reduce: pass on what came in; after world - 1 steps every rank has every part.
        total, passing = mine, mine
        for _ in range(world - 1):
            send_int(succ, passing)
            passing = recv_int(pred)
            total += passing
        pipe.send(total)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--ipc", action="store_true")
    ap.add_argument("--nccl", action="store_true")
    args = ap.parse_args()
    attach(0)
    ctx = mp.get_context("spawn")
    pipes = []
    for r in range(args.ranks):
        parent, child = ctx.Pipe()
        ctx.Process(target=rank_main, args=(r, args.ranks, child, args.ipc, args.nccl), daemon=True).start()
        pipes.append(parent)
    ports = [p.recv() for p in pipes]
    for r, p in enumerate(pipes):
        p.send(ports[(r + 1) % args.ranks])
    assert all(p.recv() == "ready" for p in pipes)
    done = [0]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/allreduce":
                for p in pipes:
                    p.send(done[0])
                sums = {p.recv() for p in pipes}
                if len(sums) != 1:
                    self.send_error(500, "ranks disagree: %s" % sorted(sums))
                    return
                done[0] += 1
                body = str(sums.pop())
            elif self.path == "/state":
                body = str(done[0])
            elif self.path in ("/detach", "/attach") and args.nccl:
                for p in pipes:
                    p.send(self.path[1:])
                if self.path == "/attach":
                    ports = [p.recv() for p in pipes]  # each rank listens, or is attached already
                    if "attached already" in ports:  # every rank is: both calls reach every rank
                        self.send_error(500, "ranks answered %s" % ports)
                        return
                    for r, p in enumerate(pipes):
                        p.send(ports[(r + 1) % args.ranks])
                answers = [p.recv() for p in pipes]
                if answers != [self.path[1:] + "ed"] * args.ranks:
                    self.send_error(500, "ranks answered %s" % answers)
                    return
                body = "ok"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode() + b"\n")

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
