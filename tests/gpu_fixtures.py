"""A GPU host made of fakes, for the GPU drivers' steps in CI (tests/fakes/fake_cuda).

The fake GPUs, the fake ``nvidia-smi`` first on PATH, the fake CUDA driver bindings
first on PYTHONPATH, where the plugin's CUDA checkpoint helper and the fake engines'
CUDA contexts find them, and a fake ``libcuda.so.1`` first on LD_LIBRARY_PATH, where a
process started from here (sparkrun, say) finds the checkpoint API's entry points. This
process started before that path was set (the loader reads it once, at start), so here
the one question asked of libcuda, whether it has the checkpoint API, is answered yes.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sparkrun_coldsnap.cuda import nvidia
from sparkrun_coldsnap.host import facts

FAKE_CUDA = Path(__file__).parent / "fakes" / "fake_cuda"
H200 = "NVIDIA H200"


def _load_state_module():
    spec = importlib.util.spec_from_file_location("fake_gpu_state", FAKE_CUDA / "fake_gpu_state.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fake_gpu_state = _load_state_module()


def engine_env() -> dict[str, str]:
    """What a workload's processes need to hold fake CUDA contexts."""
    return {"PYTHONPATH": str(FAKE_CUDA), fake_gpu_state.ENV: str(fake_gpu_state.root())}


def start_fake_cuda_workload(cmd: str, *, log_path: Path, visible: str, cuda_processes: int):
    """Start *cmd* as a host-process unit on the fake GPUs *visible*, once *cuda_processes*
    of its processes hold a fake CUDA context."""
    from sparkrun_coldsnap.cuda import checkpoint as cuda_checkpoint
    from sparkrun_coldsnap.host.iouring import io_uring_disabled
    from sparkrun_coldsnap.host.process_tree import tree_pids
    from sparkrun_coldsnap.launch.local import start_unit

    # The fake driver's own settings (FAKE_CUDA_*) reach the workload as the test set them.
    fake = {k: v for k, v in os.environ.items() if k.startswith("FAKE_CUDA_") and k != fake_gpu_state.ENV}
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": visible, **engine_env(), **fake}
    with io_uring_disabled():
        unit = start_unit(cmd, env=env, log_path=log_path)
    deadline = time.monotonic() + 30
    while len(cuda_checkpoint.cuda_processes(tree_pids(unit.root_pid))) < cuda_processes:
        assert unit.alive() and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.05)
    return unit


def n610_checkpoint(unit, images: Path):
    """The n610 driver's capture of a running fake-CUDA *unit*; the tree is gone afterwards."""
    from sparkrun_coldsnap.drivers.n610 import N610Driver
    from sparkrun_coldsnap.host.process_tree import kill_tree

    try:
        image = N610Driver().checkpoint(unit.root_pid, images, unit="solo", host="localhost", progress=lambda m: None)
    except BaseException:
        kill_tree(unit.root_pid)
        raise
    unit.reap()
    return image


@contextmanager
def fake_gpu_host(directory: Path, chips: tuple[str, ...] = (H200, H200)) -> Iterator[list[dict]]:
    mp = pytest.MonkeyPatch()
    gpus = fake_gpu_state.make_host(directory, list(chips))
    bin_dir = fake_gpu_state.install_tools(directory, sys.executable)
    mp.setenv(fake_gpu_state.ENV, str(directory))
    mp.setenv("PYTHONPATH", str(FAKE_CUDA))
    mp.setenv("PATH", "%s:%s" % (bin_dir, os.environ.get("PATH", "")))
    mp.setenv("LD_LIBRARY_PATH", ":".join(p for p in (str(directory / "lib"), os.environ.get("LD_LIBRARY_PATH")) if p))
    mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    mp.setattr(nvidia, "has_checkpoint_api", lambda: True)
    facts.gpu_facts.cache_clear()
    facts.host_facts.cache_clear()
    try:
        yield gpus
    finally:
        mp.undo()
        fake_gpu_state.remove_host(directory)
        facts.gpu_facts.cache_clear()
        facts.host_facts.cache_clear()
