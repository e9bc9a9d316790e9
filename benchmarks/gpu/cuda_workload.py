"""A small CUDA server for the GPU smoke test: device memory and a captured CUDA graph.

GET / replays the graph and answers the checksum of its output, which must be
the same before a checkpoint and after the restore.
"""

import http.server
import sys

import torch

torch.manual_seed(0)
x = torch.randn(64 << 20, device="cuda", dtype=torch.bfloat16)  # 128 MiB of device memory
y = torch.empty_like(x)
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):
    y.copy_(x * 2 + 1)  # warm-up before capture
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y.copy_(x * 2 + 1)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        graph.replay()
        torch.cuda.synchronize()
        body = ("%.6f\n" % y.float().sum().item()).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
print("ready", flush=True)
server.serve_forever()
