"""sparkrun's entry point for this plugin (group ``sparkrun.plugins``, name ``coldsnap``)."""

from __future__ import annotations

SPARKRUN_PLUGIN_API_VERSION = 1


def register(v) -> None:
    """Called by sparkrun once the plugin is enabled; registers its recipe item, probe and CLI."""
    from sparkrun_coldsnap.sparkrun_bridge import register_with_sparkrun

    register_with_sparkrun(v)
