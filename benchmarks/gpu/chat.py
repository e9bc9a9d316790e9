"""One chat completion against an OpenAI-compatible server, timed, its reply printed; the GPU
scripts' check that a workload serves.

  python3 benchmarks/gpu/chat.py BASE_URL MODEL      (BASE_URL: http://HOST:PORT)
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request


def main() -> int:
    base, model = sys.argv[1].rstrip("/"), sys.argv[2]
    body = {"model": model, "messages": [{"role": "user", "content": "Say something about snapshots."}], "max_tokens": 24, "temperature": 0}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t = time.monotonic()
    doc = json.load(urllib.request.urlopen(req, timeout=120))
    print("HTTP 200 in %.3f s, %d completion tokens: %r" % (time.monotonic() - t, doc["usage"]["completion_tokens"], doc["choices"][0]["message"]["content"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
