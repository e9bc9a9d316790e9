"""Placement on hosts without a GPU: a hardware probe that gives them one ``cpu`` slot.

sparkrun places a run only on accelerator slots; a CPU engine on a GPU-less host needs
one. The enrich step uses sparkrun's ``AcceleratorSpec`` (an internal type).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

PROBE_SCRIPT = r"""
echo "COLDSNAP_CPUS=$(nproc 2>/dev/null || echo 1)"
echo "COLDSNAP_MEM_KIB=$(awk '/^MemTotal:/ {print $2; exit}' /proc/meminfo 2>/dev/null)"
"""


def add_cpu_accelerator(parsed: Mapping[str, str], hardware: Any) -> Any:
    """Give a host with no accelerator one ``cpu`` slot, so CPU engines can be placed."""
    if hardware.accelerators or "COLDSNAP_CPUS" not in parsed:
        return hardware
    from sparkrun.core.hardware import AcceleratorSpec

    kib = parsed.get("COLDSNAP_MEM_KIB") or ""
    cpu = AcceleratorSpec(vendor="cpu", model="cpu", count=1, memory_gb=round(int(kib) / 1024 / 1024, 1) if kib.isdigit() else None, capabilities=frozenset({"cpu"}))
    return dataclasses.replace(hardware, accelerators=[*hardware.accelerators, cpu])
