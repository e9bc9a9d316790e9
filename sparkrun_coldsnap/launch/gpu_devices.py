"""A container's GPUs as entries of its OCI spec: device nodes and the driver's files.

``--gpus`` works through NVIDIA's prestart hook, which bind-mounts the driver's libraries
into the container outside its OCI spec. runc declares the spec's mounts to CRIU as
external ones and recreates them at restore; mounts made by a hook are neither, and CRIU
refuses them. So a container that will be checkpointed gets its GPUs as spec entries: the
device nodes (``--device``) and the driver's user-space files, read-only at the same
paths (``-v``). (CDI, in Docker >= 25, puts them in the spec too.)
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
from collections.abc import Sequence
from pathlib import Path

from sparkrun_coldsnap.errors import CaptureError, ToolError
from sparkrun_coldsnap.host.runner import run

#: Device nodes every CUDA process needs besides its GPUs.
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
#: The driver's user-space files a CUDA process loads (what NVIDIA's hook would mount).
DRIVER_FILE_PATTERNS = ("libcuda.so*", "libnvidia-ml.so*", "libnvidia-ptxjitcompiler.so*", "libnvidia-nvvm.so*", "libcudadebugger.so*")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64")


def device_args(gpus: Sequence[str], *, dev: Path = Path("/dev"), library_dirs: Sequence[str] | None = None) -> list[str]:
    """``docker create`` arguments giving a container GPUs *gpus* (indices) as spec entries."""
    args: list[str] = []
    for index in gpus:
        if not re.fullmatch(r"\d+", index):
            raise CaptureError("GPU %r is not an index: name the unit's GPUs by number" % index)
        node = dev / ("nvidia%s" % index)
        if not node.exists():
            raise CaptureError("GPU %s has no device node %s on this host" % (index, node))
        args += ["--device", str(node)]
    for name in CONTROL_DEVICES:
        node = dev / Path(name).name
        if node.exists():
            args += ["--device", str(node)]
    for path in driver_files(library_dirs):
        args += ["-v", "%s:%s:ro" % (path, path)]
    return args


def host_gpus(visible: str | None = None, *, dev: Path = Path("/dev")) -> tuple[str, ...]:
    """The GPU indices a single-host container gets: every GPU with a device node here, or those
    *visible* (``CUDA_VISIBLE_DEVICES`` as indices) names. sparkrun's placement gives a solo run
    no device list (a host-process engine sees every GPU and CUDA_VISIBLE_DEVICES picks), but a
    container sees only the devices its spec names: without them the engine finds no GPU."""
    present = sorted((m.group(1) for m in (re.fullmatch(r"nvidia(\d+)", p.name) for p in dev.glob("nvidia*")) if m), key=int)
    if visible is None or not visible.strip():
        return tuple(present)
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(re.fullmatch(r"\d+", v) for v in wanted):
        return tuple(present)  # UUIDs or MIG names: CUDA picks among all of them inside the container
    return tuple(v for v in wanted if v in present)


def driver_files(library_dirs: Sequence[str] | None = None) -> list[str]:
    """The driver's user-space files in *library_dirs* (default: the distributions' library
    directories and wherever the loader finds the driver's libraries)."""
    found: list[str] = []
    for d in library_dirs if library_dirs is not None else driver_library_dirs():
        for pattern in DRIVER_FILE_PATTERNS:
            found += [f for f in sorted(glob.glob(os.path.join(d, pattern))) if f not in found]
    return found


def driver_library_dirs(loader_cache: str | None = None) -> list[str]:
    """The distributions' library directories, then every directory the loader's cache
    (``ldconfig -p``, or *loader_cache*) finds a driver library in, and where its links lead.

    Not every machine keeps the driver where a distribution's package puts it: some install it
    under /usr/local/nvidia/lib64 with links in /lib; a container needs the files of both."""
    if loader_cache is None:
        try:
            loader_cache = run(["ldconfig", "-p"], timeout=30, check=False).stdout
        except ToolError:  # no ldconfig, or no answer: the distributions' directories alone
            loader_cache = ""
    dirs = list(LIBRARY_DIRS)
    for line in loader_cache.splitlines():
        name, _, path = line.strip().partition(" => ")
        if not path or not any(fnmatch.fnmatch(name.split()[0], p) for p in DRIVER_FILE_PATTERNS):
            continue
        for d in (os.path.dirname(path), os.path.dirname(os.path.realpath(path))):
            if d not in dirs:
                dirs.append(d)
    return dirs
