"""Two processes whose memory holds every kind of page a dump's zero-page rewrite must tell apart.

The parent fills a private anonymous area (some pages data, the rest zeros written on
purpose, so they are present and dumped), maps a file privately and overwrites a few of its
pages with zeros, then forks. The child inherits the area and changes it: zeros over some of
the parent's data pages (a child page of zeros where the parent has data) and data over some
of its zero pages. GET /digest answers with each process's digests of both areas; they must
be the same after a restore.
"""

import argparse
import hashlib
import http.server
import json
import mmap
import os

PAGE = 4096


def digests(area, mapped) -> dict:
    return {"anon": hashlib.sha256(area).hexdigest(), "file": hashlib.sha256(mapped).hexdigest()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--file", required=True)
    ap.add_argument("--pages", type=int, default=2048)
    args = ap.parse_args()
    area = mmap.mmap(-1, args.pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(args.pages):
        area[i * PAGE : (i + 1) * PAGE] = bytes([i % 251 + 1]) * PAGE if i % 3 == 0 else bytes(PAGE)
    with open(args.file, "wb") as f:
        f.write(b"f" * (64 * PAGE))
    with open(args.file, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
    for i in range(4):
        mapped[i * PAGE : (i + 1) * PAGE] = bytes(PAGE)  # zeros over the file's bytes: must stay zeros
    ask_r, ask_w = os.pipe()
    answer_r, answer_w = os.pipe()
    if os.fork() == 0:
        for i in range(args.pages):
            if i % 6 == 0:
                area[i * PAGE : (i + 1) * PAGE] = bytes(PAGE)  # the parent has data here
            elif i % 3 == 1:
                area[i * PAGE : (i + 1) * PAGE] = b"c" * PAGE
        while os.read(ask_r, 1):
            os.write(answer_w, (json.dumps(digests(area, mapped)) + "\n").encode())
        os._exit(0)
    answers = os.fdopen(answer_r)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            os.write(ask_w, b"?")
            body = json.dumps({"parent": digests(area, mapped), "child": json.loads(answers.readline())}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", args.port), Handler)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
