"""vLLM's serving benchmark (``vllm bench serve``) as the load client of ``bench --load``.

The random dataset needs no download: prompts are drawn from the tokenizer's vocabulary
with the seed given, so every round sends the same requests. ``--ignore-eos`` makes every
reply as long as asked, so rounds produce the same number of tokens whatever the model
says. The engine's account of itself comes from its Prometheus endpoint: the KV cache it
allocated (``vllm:cache_config_info``, labelled with the blocks and their size) and its use.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.engines.serving_bench import EngineReport, LoadResult, LoadSpec, ServingBench, number, prometheus_samples
from sparkrun_coldsnap.errors import EngineError

WHAT = "vllm bench serve"


class VllmServingBench(ServingBench):
    script = "vllm"

    def argv(self, spec: LoadSpec, endpoint: Endpoint, *, tokenizer: str, result_file: Path) -> list[str]:
        return [
            "bench", "serve", "--backend", "openai", "--base-url", endpoint.base_url, "--endpoint", "/v1/completions",
            "--model", endpoint.served_model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(spec.input_len), "--random-output-len", str(spec.output_len),
            "--num-prompts", str(spec.prompts), "--max-concurrency", str(spec.concurrency), "--seed", str(spec.seed),
            "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(result_file.parent), "--result-filename", result_file.name,
        ]  # fmt: skip

    def result(self, raw: Mapping[str, Any]) -> LoadResult:
        errors = tuple(str(e) for e in raw.get("errors") or () if e)
        return LoadResult(
            completed=int(number(raw, "completed", WHAT)), failed=int(raw.get("failed") or 0) or len(errors),
            duration_seconds=number(raw, "duration", WHAT), output_tokens_per_second=number(raw, "output_throughput", WHAT),
            requests_per_second=number(raw, "request_throughput", WHAT),
            ttft_ms={"p50": number(raw, "p50_ttft_ms", WHAT), "p99": number(raw, "p99_ttft_ms", WHAT)},
            itl_ms={"p50": number(raw, "p50_itl_ms", WHAT), "p99": number(raw, "p99_itl_ms", WHAT)},
            errors=errors[:5],  # a few say why; the count says how many
        )  # fmt: skip

    def report(self, endpoint: Endpoint) -> EngineReport:
        import requests

        try:
            r = requests.get(endpoint.base_url + "/metrics", timeout=30, headers={"Connection": "close"})
            r.raise_for_status()
        except requests.RequestException as err:
            raise EngineError("reading the engine's metrics at %s/metrics failed: %s" % (endpoint.base_url, err)) from err
        samples = prometheus_samples(r.text)
        info = next((labels for name, labels, _ in samples if name == "vllm:cache_config_info"), {})
        blocks = int(info["num_gpu_blocks"]) if info.get("num_gpu_blocks", "").isdigit() else None
        size = int(info["block_size"]) if info.get("block_size", "").isdigit() else None
        usage = next((v for name, _, v in samples if name == "vllm:kv_cache_usage_perc"), None)
        details: dict[str, Any] = {k: info[k] for k in ("block_size", "cache_dtype", "num_cpu_blocks", "enable_prefix_caching", "gpu_memory_utilization") if k in info}
        return EngineReport(kv_cache_blocks=blocks, kv_cache_tokens=blocks * size if blocks and size else None, kv_cache_usage=usage, details=details)


VLLM_SERVING_BENCH = VllmServingBench()
