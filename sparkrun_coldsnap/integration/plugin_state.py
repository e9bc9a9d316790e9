"""Is our sparkrun plugin enabled, and does another distribution claim its name? (for doctor)

Reads sparkrun's ``plugin_policy`` and ``installed_plugins`` (internals).
"""

from __future__ import annotations

from typing import Any

from sparkrun_coldsnap.integration.recipe_item import KEY


def plugin_state() -> dict[str, Any]:
    """Is our sparkrun plugin enabled, and does another distribution claim its name?"""
    out: dict[str, Any] = {"enabled": None, "reason": None, "providers": [], "problem": None}
    try:
        from sparkrun.core.installed_plugins import installed_plugin_inventory
        from sparkrun.core.plugin_policy import PluginSource
        from sparkrun.core.plugin_policy import plugin_state as sr_state

        st = sr_state(KEY, source=PluginSource.INSTALLED)
        out["enabled"] = bool(getattr(st, "enabled", False))
        out["reason"] = str(getattr(st, "reason", "") or "")
        rows = [r for r in installed_plugin_inventory() if getattr(r, "name", None) == KEY]
        out["providers"] = sorted({str(getattr(r, "distribution", None) or getattr(r, "module", None) or r) for r in rows})
        failures = [str(getattr(r, "failure", "")) for r in rows if getattr(r, "failure", None)]
        if failures:
            out["problem"] = failures[0]
    except Exception as err:  # noqa: BLE001 - doctor reports, it does not crash
        out["problem"] = "cannot read sparkrun's plugin state: %s" % err
    return out
