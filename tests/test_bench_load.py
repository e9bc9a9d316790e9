"""``bench --load``: the load asked for, the engine benchmark's results read back, what the
engine says of itself, the side-by-side document, and the refusals that come before
anything is captured or started. The real run against the CPU engine is in
tests/test_engine_cycle.py."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
from click.testing import CliRunner
from conftest import write_recipe
from helpers import one_error_line, synthetic_workload

from sparkrun_coldsnap import bench_load
from sparkrun_coldsnap.bench_load import RESTORED, Round
from sparkrun_coldsnap.cli import coldsnap_group
from sparkrun_coldsnap.documents.capsule_ref import CapsuleRef
from sparkrun_coldsnap.documents.request import RestoreRequest, ValidationSpec
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.engines.serving_bench import EngineReport, LoadResult, LoadSpec, prometheus_samples
from sparkrun_coldsnap.engines.vllm_bench import VllmServingBench
from sparkrun_coldsnap.errors import EngineError, RequestError

#: the lines of a CPU vLLM's /metrics that the report reads (labels as vLLM writes them)
METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_cpu_blocks="None",num_gpu_blocks="4096"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="coldsnap/tiny-qwen2"} 0.25
process_resident_memory_bytes 1.2e+09
"""


def test_a_load_spec_takes_any_subset_and_keeps_the_rest_default():
    assert LoadSpec.parse("") == LoadSpec()
    assert LoadSpec.parse("prompts=8, concurrency=4,output=16") == LoadSpec(prompts=8, concurrency=4, input_len=128, output_len=16, seed=0)
    assert LoadSpec.parse("seed=0,input=32") == LoadSpec(input_len=32, seed=0)


@pytest.mark.parametrize("text", ["prompts", "prompts=x", "prompts=0", "rate=4", "concurrency=-1"])
def test_a_bad_load_spec_is_one_line_naming_it_and_the_form(tmp_path, text):
    recipe = write_recipe(tmp_path)
    result = CliRunner().invoke(coldsnap_group, ["bench", str(recipe), "--load", text], catch_exceptions=False)
    line = one_error_line(result.exit_code, result.output)
    assert "bench --load" in line and repr(text) in line and "prompts=64,concurrency=16" in line, line


def test_load_and_lifecycle_together_are_refused(tmp_path):
    result = CliRunner().invoke(coldsnap_group, ["bench", str(write_recipe(tmp_path)), "--load", "--lifecycle"], catch_exceptions=False)
    assert "give one of them" in one_error_line(result.exit_code, result.output)


def request(**launch) -> RestoreRequest:
    w = synthetic_workload()
    w = w.model_copy(update={"launch": w.launch.model_copy(update={"engine_env": "vllm-cpu", **launch})})
    return RestoreRequest(workload=w, validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="x"), workload_name="w")


def test_an_engine_without_a_benchmark_client_is_refused_naming_the_alternative():
    req = request()
    req = req.model_copy(update={"workload": req.workload.model_copy(update={"engine": "sglang", "runtime": "sglang"})})
    with pytest.raises(RequestError, match="engine sglang has none the plugin knows: time its start with bench RECIPE instead"):
        bench_load.client_for(req)


def test_a_container_workload_is_refused_naming_the_engine_environment():
    with pytest.raises(RequestError, match=r"has none \(executor docker\): use a host-process recipe with coldsnap.engine_env"):
        bench_load.client_for(request(executor="docker", image="img@sha256:" + "0" * 64))


def test_an_engine_environment_without_the_client_is_refused_naming_setup(lifecycle_home):
    (lifecycle_home / "engines" / "vllm-cpu" / "bin").mkdir(parents=True)
    with pytest.raises(RequestError, match=r"has no .*bin/vllm \(the benchmark client\): run `sparkrun coldsnap setup --engine vllm-cpu`"):
        bench_load.client_for(request())


def test_the_client_is_the_engine_environments_script_against_the_served_model(lifecycle_home):
    script = lifecycle_home / "engines" / "vllm-cpu" / "bin" / "vllm"
    script.parent.mkdir(parents=True)
    script.write_text("")
    client = bench_load.client_for(request(command="python -m vllm.entrypoints.openai.api_server --served-model-name tiny", port=8123))
    assert client.script == script and client.endpoint == Endpoint("http://127.0.0.1:8123", "tiny")
    argv = client.bench.argv(LoadSpec(prompts=8, concurrency=4, input_len=32, output_len=16, seed=7), client.endpoint, tokenizer="/m", result_file=lifecycle_home / "r.json")
    pairs = dict(zip(argv[2::1], argv[3::1]))
    assert argv[:2] == ["bench", "serve"] and "--ignore-eos" in argv
    assert {k: pairs[k] for k in ("--dataset-name", "--num-prompts", "--max-concurrency", "--random-input-len", "--random-output-len", "--seed", "--model", "--tokenizer")} == {
        "--dataset-name": "random", "--num-prompts": "8", "--max-concurrency": "4", "--random-input-len": "32", "--random-output-len": "16", "--seed": "7",
        "--model": "tiny", "--tokenizer": "/m",
    }  # fmt: skip
    assert pairs["--result-dir"] == str(lifecycle_home) and pairs["--result-filename"] == "r.json"


def test_prometheus_samples_are_read_with_their_labels_and_comments_skipped():
    samples = prometheus_samples(METRICS)
    assert [name for name, _, _ in samples] == ["vllm:cache_config_info", "vllm:kv_cache_usage_perc", "process_resident_memory_bytes"]
    assert samples[0][1]["num_gpu_blocks"] == "4096" and samples[1] == ("vllm:kv_cache_usage_perc", {"engine": "0", "model_name": "coldsnap/tiny-qwen2"}, 0.25)
    assert samples[2][2] == 1.2e9


def test_the_vllm_report_reads_kv_capacity_from_the_metrics_endpoint():
    import http.server
    import threading

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = METRICS.encode() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        report = VllmServingBench().report(Endpoint("http://127.0.0.1:%d" % server.server_address[1], "m"))
    finally:
        server.shutdown()
    assert (report.kv_cache_blocks, report.kv_cache_tokens, report.kv_cache_usage) == (4096, 4096 * 128, 0.25)
    assert report.details["block_size"] == "128" and report.cuda_graphs is None


def test_the_vllm_report_names_an_endpoint_that_does_not_answer():
    with pytest.raises(EngineError, match=r"reading the engine's metrics at http://127.0.0.1:9/metrics failed"):
        VllmServingBench().report(Endpoint("http://127.0.0.1:9", "m"))


RAW = {
    "completed": 8, "failed": 0, "duration": 2.0, "output_throughput": 64.0, "request_throughput": 4.0,
    "p50_ttft_ms": 100.0, "p99_ttft_ms": 150.0, "p50_itl_ms": 7.0, "p99_itl_ms": 60.0, "errors": ["", "", ""],
}  # fmt: skip


def test_the_vllm_result_is_read_and_a_changed_format_is_named():
    result = VllmServingBench().result(RAW)
    assert result == LoadResult(8, 0, 2.0, 64.0, 4.0, {"p50": 100.0, "p99": 150.0}, {"p50": 7.0, "p99": 60.0}, ())
    failed = VllmServingBench().result({**RAW, "failed": 0, "errors": ["", "connection reset", "timeout"]})
    assert failed.failed == 2 and failed.errors == ("connection reset", "timeout")
    with pytest.raises(EngineError, match=r"vllm bench serve: the result has no number 'p50_itl_ms'.*format changed"):
        VllmServingBench().result({k: v for k, v in RAW.items() if k != "p50_itl_ms"})


def a_round(path: str, index: int, tokens_per_s: float, *, blocks: int = 4096, failed: int = 0, reply: str = "a cold start") -> Round:
    load = replace(VllmServingBench().result(RAW), output_tokens_per_second=tokens_per_s, failed=failed)
    engine = EngineReport(kv_cache_blocks=blocks, kv_cache_tokens=blocks * 128)
    return Round(path, index, load, engine, 1 << 30, 40.0 if path == "vanilla" else 1.5, reply, True, prepare_seconds=None if path == "vanilla" else 0.5)


def document(rounds: list[Round]) -> dict:
    client = bench_load.Client(VllmServingBench(), script=__import__("pathlib").Path("/e/bin/vllm"), endpoint=Endpoint("http://127.0.0.1:8000", "m"), tokenizer="/m")
    return bench_load.document(request(), rounds, spec=LoadSpec(), client=client, capsule={"ref": "x:latest", "digest": "sha256:0"}, drop_cache=False)


def test_the_document_puts_medians_side_by_side_and_checks_what_is_stable(tmp_path):
    rounds = [a_round(p, i, t) for i, (v, r) in enumerate([(500.0, 4000.0), (4000.0, 600.0), (3000.0, 3500.0)]) for p, t in (("vanilla", v), (RESTORED, r))]
    doc = document(rounds)
    assert doc["rounds"] == 3 and [s["path"] for s in doc["samples"]] == ["vanilla", RESTORED] * 3
    assert doc["vanilla"]["output_tokens_per_second"] == {"median": 3000.0, "min": 500.0, "max": 4000.0, "n": 3}
    assert doc[RESTORED]["output_tokens_per_second"]["median"] == statistics.median([4000.0, 600.0, 3500.0])
    assert doc["ratio_median"]["output_tokens_per_second"] == 3500.0 / 3000.0
    assert doc["checks"] == {"no_errors": True, "same_replies": True, "same_kv_capacity": True, "all_validated": True}
    assert doc["vanilla"]["cuda_graphs"] == "n/a (cpu)" and doc["vanilla"]["kv_cache_blocks"] == [4096]
    text = bench_load.table(doc)
    assert "output tokens per second" in text and "3000.0 (500.0-4000.0)" in text and "checks: no errors yes" in text
    json_path, png = bench_load.write(doc, tmp_path / "out")
    assert json_path.exists() and (png is None or png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize(
    "changed, check",
    [(dict(failed=1), "no_errors"), (dict(blocks=2048), "same_kv_capacity"), (dict(reply="a warm start"), "same_replies")],
)
def test_a_restore_that_differs_fails_its_check(changed, check):
    doc = document([a_round("vanilla", 0, 1000.0), a_round(RESTORED, 0, 1000.0, **changed)])
    assert doc["checks"][check] is False and sum(not v for v in doc["checks"].values()) == 1, doc["checks"]
    assert "%s NO" % check.replace("_", " ") in bench_load.table(doc)
