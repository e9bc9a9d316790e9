"""FAKE engine that compiles into its caches (no model, no GPU, no compiler).

Started as ``python -m fake_compiling_engine --port P --caches VAR[,VAR...]`` (through the n580
template launcher in the tests). Past its start it "compiles" one kernel per cache variable, as
torch.compile, Triton and FlashInfer do with theirs: it looks for the kernel's entry under the
folder the variable names, as the environment gave it at start (a template's memory holds that
environment), and writes it only where it is missing. ``GET /cache`` answers, for each
variable, ``hit`` (the entry was there) or ``miss`` (it compiled and wrote it).
"""

import argparse
import hashlib
import http.server
import json
import os
from pathlib import Path

#: what a kernel of this fake is: its entry's name is a hash of it, as a real cache names entries
SOURCE = b"FAKE kernel: add one to every element\n"


def compile_into(folder: str) -> str:
    entry = Path(folder) / hashlib.sha256(SOURCE).hexdigest()[:16] / "kernel.bin"
    if entry.is_file() and entry.read_bytes() == SOURCE * 64:
        return "hit"
    entry.parent.mkdir(parents=True, exist_ok=True)
    partial = entry.with_name("kernel.bin.partial")
    partial.write_bytes(SOURCE * 64)
    partial.rename(entry)
    return "miss"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--caches", required=True)
    args = parser.parse_args()
    found = {var: compile_into(os.environ[var]) for var in args.caches.split(",")}
    body = json.dumps(found).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/cache" else 404)
            self.end_headers()
            if self.path == "/cache":
                self.wfile.write(body)

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
