"""What a rank's log says of its failure: the first error ahead of the echoes that follow it."""

from __future__ import annotations

import pytest

from sparkrun_coldsnap.controller.common import Attempt
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
from sparkrun_coldsnap.errors import RestoreError
from sparkrun_coldsnap.host import log_cause

# Lines as a restored vLLM rank printed them on a GPU when its CUDA context had been broken.
GPU_RANK = """\
(APIServer pid=10020) WARNING 12-07 09:58:10 [system_utils.py:299] Found ulimit of 20000 and failed to automatically increase with error current limit exceeds maximum limit.
TMA Desc Addr:   0x7fff498cec80
Error: Failed to initialize the TMA descriptor 719
CUDA error (/workspace/.deps/vllm-flash-attn-src/hopper/flash_fwd_launch_template.h:199): unspecified launch failure
(EngineCore pid=10252) ERROR 12-07 10:01:21 [multiproc_executor.py:284] Worker proc VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.
(EngineCore pid=10252) ERROR 12-07 10:01:22 [core.py:1332] EngineCore encountered a fatal error.
(EngineCore pid=10252) ERROR 12-07 10:01:22 [core.py:1332] Traceback (most recent call last):
(Worker_TP0 pid=2931) ERROR 12-07 10:10:29 [multiproc_executor.py:948] torch.AcceleratorError: CUDA error: unspecified launch failure
(Worker_TP0 pid=2931) ERROR 12-07 10:10:29 [multiproc_executor.py:948] Search for `cudaErrorLaunchFailure' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.
(EngineCore pid=2767) ERROR 12-07 10:10:29 [core.py:1332] RuntimeError: Worker failed with error 'CUDA error: unspecified launch failure
"""

# A rank whose collectives could not connect: the cause comes first, the wrapper, which points
# back at it, last.
GLOO_RANK = """\
INFO 12-07 08:01:02 [parallel_state.py:100] world_size=2 rank=1
(Worker pid=77) ERROR 12-07 08:01:09 [multiproc_executor.py:700] RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error
(Worker pid=77) ERROR 12-07 08:01:09 [multiproc_executor.py:700] Traceback (most recent call last):
Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
"""


def test_the_first_error_leads_and_the_echoes_are_left_out():
    assert log_cause.causes(GPU_RANK) == ["Error: Failed to initialize the TMA descriptor 719", "torch.AcceleratorError: CUDA error: unspecified launch failure"]
    summary = log_cause.summary(GPU_RANK)
    assert summary.startswith("first error: Error: Failed to initialize the TMA descriptor 719; last error: ")
    assert "EngineCore encountered" not in summary and "ulimit" not in summary


def test_a_wrapper_exception_does_not_hide_the_cause():
    (only,) = log_cause.causes(GLOO_RANK)
    assert only.startswith("RuntimeError: Gloo connectFullMesh failed")


def test_a_log_that_states_no_error_is_quoted_by_its_end():
    assert log_cause.causes("starting\nloading weights\nready") == []
    assert log_cause.summary("a\n\nb\nc\nd\ne\nf", tail_lines=3) == "d | e | f"
    assert log_cause.summary("") == "empty"


def test_a_long_error_line_is_cut():
    (only,) = log_cause.causes("ValueError: " + "x" * 1000)
    assert len(only) == log_cause.LIMIT


def test_what_a_failure_adds_may_be_asked_after_the_units_are_stopped():
    found: list[str] = []

    def stop() -> list[str]:
        found.append("rank-1 on host b: first error: CUDA error: unspecified launch failure")
        return []

    rb = ReceiptBuilder("restore")
    with pytest.raises(RestoreError) as err, Attempt(rb) as attempt:
        attempt.stops(stop, told=lambda: "every unit restored has been stopped; the ranks' logs: %s" % " | ".join(found))
        raise RestoreError("validation failed")
    assert err.value.message == "validation failed; every unit restored has been stopped; the ranks' logs: rank-1 on host b: first error: CUDA error: unspecified launch failure"
