"""FAKE GPUs (tests only): what the fake CUDA driver and the fake CUDA processes share.

The real driver keeps a process's checkpoint state inside that process's libcuda and
talks to it through the kernel module; here both sides meet in files under
``$FAKE_CUDA_DIR``:

* ``gpus.json``: this host's GPUs in CUDA's order, each ``{"uuid", "chip", "device"}``,
  ``device`` a file standing for its ``/dev/nvidia*`` node (a process holds it open while
  it has a context on that GPU, so the project's ``/dev/nvidia`` scan finds it);
* ``req-<pid>.json`` / ``ans-<pid>.json``: one driver call on a process and its answer.
  The process's checkpoint state lives in the process, as libcuda's does (a process
  restored from images is in the state it was dumped in); a thread of the process carries
  out each call on it and answers, as libcuda does for the real driver;
* ``fail-<op>``: while it exists, every process of this host answers *op* (``checkpoint``,
  ``restore``)
  with the CUDA error it names (a test's fault, on one host only);
* ``proc-<pid>.json``: what the process last reported (state, GPUs, every GPU of the host
  it started on, whether it holds a collective communicator now and whether a checkpoint
  while it held one broke its context), for ``nvidia-smi`` and for tests to read.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path

ENV = "FAKE_CUDA_DIR"


def root() -> Path:
    return Path(os.environ[ENV])


def gpus() -> list[dict]:
    return json.loads((root() / "gpus.json").read_text())


def proc_path(pid: int) -> Path:
    return root() / ("proc-%d.json" % pid)


def read_proc(pid: int) -> dict | None:
    return read_json(proc_path(pid))


def write_proc(pid: int, doc: dict) -> None:
    write_json(proc_path(pid), doc)


def write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name("%s.%d.tmp" % (path.name, os.getpid()))
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)  # readers never see half a document


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def request_path(pid: int) -> Path:
    return root() / ("req-%d.json" % pid)


def answer_path(pid: int) -> Path:
    return root() / ("ans-%d.json" % pid)


def tell_to_fail(op: str, error: str, directory: Path | None = None) -> Path:
    """Every process of the host in *directory* (default: this one's) answers *op* with *error*
    until the returned file is removed."""
    path = (directory or root()) / ("fail-%s" % op)
    path.write_text(error)
    return path


def told_to_fail(op: str) -> str | None:
    try:
        return (root() / ("fail-%s" % op)).read_text().strip() or None
    except FileNotFoundError:
        return None


def make_host(directory: Path, chips: list[str]) -> list[dict]:
    """A host with one fake GPU per chip name: ``gpus.json`` and a device file per GPU.

    The device files live under ``/dev`` (named ``nvidia-fake-*``) because that is where
    the plugin looks for a process's GPU handles; :func:`remove_host` deletes them.
    """
    directory.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(4)
    out = []
    for i, chip in enumerate(chips):
        device = Path("/dev/nvidia-fake-%s-%d" % (token, i))
        device.write_bytes(b"")
        out.append({"uuid": "GPU-%s-0000-4000-8000-%012d" % (token, i), "chip": chip, "device": str(device)})
    (directory / "gpus.json").write_text(json.dumps(out))
    return out


def remove_host(directory: Path) -> None:
    for gpu in json.loads((directory / "gpus.json").read_text()):
        Path(gpu["device"]).unlink(missing_ok=True)


def install_tools(directory: Path, python: str) -> Path:
    """A ``bin`` folder with the fake ``nvidia-smi``, run by *python* with these modules on its path,
    and a ``lib`` folder beside it with the fake ``libcuda.so.1`` (built with the C compiler)."""
    here = Path(__file__).resolve().parent
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\nPYTHONPATH=%s exec %s %s "$@"\n' % (here, python, here / "fake_nvidia_smi.py"))
    smi.chmod(0o755)
    lib_dir = directory / "lib"
    lib_dir.mkdir(exist_ok=True)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib_dir / "libcuda.so.1"), str(here / "libcuda_fake.c")], check=True)
    return bin_dir
