"""An engine's own serving benchmark, driven as a client against a served endpoint.

The plugin does not measure load itself: the engine ships a benchmark client (vLLM's
``vllm bench serve``) that its users already trust, so a restored server is put under the
same load, by the same client, as a freshly started one. An adapter names the client it
has (``EngineAdapter.serving_bench``); this module holds what every client shares: the
load asked for, the figures read back, and what the engine says about itself.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import EngineError


@dataclass(frozen=True)
class LoadSpec:
    """Random prompts of fixed lengths drawn from a fixed seed, at most *concurrency* in
    flight: the same requests, in the same order, on every round."""

    prompts: int = 64
    concurrency: int = 16
    input_len: int = 128
    output_len: int = 64
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> LoadSpec:
        """``prompts=64,concurrency=16,input=128,output=64,seed=0`` (any subset; the rest default)."""
        names = {"prompts": "prompts", "concurrency": "concurrency", "input": "input_len", "output": "output_len", "seed": "seed"}
        values: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in names or not value.strip().isdigit() or (int(value) < 1 and key.strip() != "seed"):
                raise ValueError("load %r: write KEY=N pairs separated by commas, KEY one of %s, N a positive integer (e.g. prompts=64,concurrency=16)" % (text, ", ".join(names)))
            values[names[key.strip()]] = int(value)
        return cls(**values)

    def label(self) -> str:
        return "%d prompts, %d in flight, %d tokens in, %d out, seed %d" % (self.prompts, self.concurrency, self.input_len, self.output_len, self.seed)


@dataclass(frozen=True)
class LoadResult:
    """What one run of the client measured (latencies in milliseconds)."""

    completed: int
    failed: int
    duration_seconds: float
    output_tokens_per_second: float
    requests_per_second: float
    ttft_ms: dict[str, float]  # "p50", "p99"
    itl_ms: dict[str, float]
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineReport:
    """What the engine says about itself while it serves (None: it does not say)."""

    kv_cache_blocks: int | None = None
    kv_cache_tokens: int | None = None
    kv_cache_usage: float | None = None
    cuda_graphs: bool | None = None
    details: dict[str, Any] = field(default_factory=dict)


class ServingBench(ABC):
    """An engine's benchmark client: how to call it, and how to read what it wrote."""

    #: the console script of the engine's environment that is the client
    script: ClassVar[str]

    @abstractmethod
    def argv(self, spec: LoadSpec, endpoint: Endpoint, *, tokenizer: str, result_file: Path) -> list[str]:
        """The arguments after the script: *spec* against *endpoint*, results written to *result_file*."""

    @abstractmethod
    def result(self, raw: Mapping[str, Any]) -> LoadResult:
        """The client's result document read into a :class:`LoadResult` (EngineError if it is not one)."""

    @abstractmethod
    def report(self, endpoint: Endpoint) -> EngineReport:
        """What the serving engine says about itself."""


_SAMPLE_RE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def prometheus_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition: (name, labels, value), comments skipped."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE_RE.match(line)
        if not m or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL_RE.findall(m.group(2) or "")), value))
    return out


def number(raw: Mapping[str, Any], key: str, what: str) -> float:
    value = raw.get(key)
    if not isinstance(value, (int, float)):
        raise EngineError("%s: the result has no number %r (got %r): the client's result format changed" % (what, key, value))
    return float(value)
