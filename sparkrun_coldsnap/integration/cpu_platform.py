"""The hardware platform of hosts the plugin's probe gives a ``cpu`` slot: gloo over TCP.

sparkrun chooses a collective backend for every launch of more than one rank from the
platform that claims the host (``sparkrun.core.backend_select.select_backends``); its
built-in platforms claim NVIDIA hosts only, so a CPU run across hosts stopped with "No
backend matches host hardware". vLLM's CPU build forms its distributed group with
torch's gloo backend over TCP, which needs no fabric: this platform claims the ``cpu``
slot and names gloo as its collective. It is registered through ``register_platform``,
which ``sparkrun.plugins`` exports for plugins.
"""

from __future__ import annotations

from typing import Any

from sparkrun.orchestration.collectives.base import CollectiveBackend
from sparkrun.platforms.base import HardwarePlatformPlugin

VENDOR = "cpu"  # the vendor of the slot sparkrun_coldsnap.integration.probe adds


class GlooBackend(CollectiveBackend):
    """Collective env for gloo over TCP on the hosts' own network."""

    name = "gloo"
    vendor = VENDOR

    def env_for_host(self, ib_info: dict[str, str], *, topology: str | None = None) -> dict[str, str]:
        # sparkrun's detection reports the management interface only on hosts with an
        # InfiniBand fabric; where it does, gloo and NODE_IP follow it. Otherwise the plugin
        # binds gloo to the interface holding the address sparkrun placed the rank at, found
        # on its host before the ranks start (controller/socket_ifnames.py); a recipe (or the
        # cluster's env file) that sets GLOO_SOCKET_IFNAME keeps its own.
        iface = ib_info.get("DETECTED_SOCKET_IFNAME", "").strip()
        address = ib_info.get("DETECTED_MGMT_IP", "").strip()
        env = {"GLOO_SOCKET_IFNAME": iface} if iface else {}
        if address:
            env["NODE_IP"] = address
        return env

    def ring_overrides(self, ib_info: dict[str, str]) -> dict[str, str]:
        return {}  # gloo has no ring-specific settings


class CpuPlatform(HardwarePlatformPlugin):
    """Hosts whose only accelerator is the plugin's ``cpu`` slot."""

    platform_name = "coldsnap-cpu"
    display_name = "CPU (ColdSnap)"
    vendors = frozenset({VENDOR})

    def matches(self, host_hardware: Any) -> bool:
        accelerators = list(getattr(host_hardware, "accelerators", ()) or ())
        return bool(accelerators) and all(a.vendor == VENDOR for a in accelerators)

    def accelerator_vendor(self) -> str:
        return VENDOR

    def collective_backend(self) -> CollectiveBackend:
        return GlooBackend()


def register() -> None:
    """Register the platform; registering it again is a no-op in sparkrun's registry."""
    from sparkrun.plugins import register_platform

    register_platform(CpuPlatform())
