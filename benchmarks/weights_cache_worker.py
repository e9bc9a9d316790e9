"""The engine side of benchmarks/weights_cache.py: holds a model of random weights in
the engine's interpreter and writes or reads its native payload on request.

It runs the same reader a vLLM worker runs (engine_side/coldsnap_native_weights.py),
mixed into a stand-in worker. Requests and answers are JSON lines on stdin/stdout.
"""

from __future__ import annotations

import json
import sys

import torch
from coldsnap_native_weights import NativeWeights

PARAM = 64 << 20  # bytes per parameter tensor


class Worker(NativeWeights):
    rank = 0

    def __init__(self, total: int) -> None:
        model = torch.nn.Module()
        g = torch.Generator().manual_seed(0)
        for i in range(max(1, total // PARAM)):
            t = torch.randint(-(2**15), 2**15, (PARAM // 2,), dtype=torch.int16, generator=g).view(torch.bfloat16)
            model.register_parameter("p%d" % i, torch.nn.Parameter(t, requires_grad=False))
        self.model = model

    def _coldsnap_model(self):
        return self.model


def main() -> None:
    worker = Worker(int(sys.argv[1]))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "export":
            out = worker.coldsnap_export_native(req["dir"])
        else:
            out = worker.coldsnap_load_native(req["dir"], req.get("cached", False))
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
