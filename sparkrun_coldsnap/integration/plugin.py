"""sparkrun's entry point for this plugin (group ``sparkrun.plugins``, name ``coldsnap``).

sparkrun 0.4.2 finds installed plugins through that entry-point group, keeps them
disabled until enabled, then calls :func:`register` once. What is registered: the
``coldsnap:`` recipe item with its execution strategy, the hardware probe for hosts
without a GPU, the platform that gives those hosts a collective backend (gloo), and the
``sparkrun coldsnap`` command group.
"""

from __future__ import annotations

from typing import Any

SPARKRUN_PLUGIN_API_VERSION = 1


def _cli_loader() -> Any:
    from sparkrun_coldsnap.cli import coldsnap_group

    return coldsnap_group


def register(v: Any) -> None:
    """Called by sparkrun once the plugin is enabled."""
    from sparkrun.plugins import register_cli_command, register_hardware_probe, register_recipe_item

    from sparkrun_coldsnap.integration import cpu_platform, lifecycle_provider, name_claims
    from sparkrun_coldsnap.integration.probe import PROBE_SCRIPT, add_cpu_accelerator
    from sparkrun_coldsnap.integration.recipe_item import KEY, OWNER, RecipeItem
    from sparkrun_coldsnap.integration.strategy import Strategy

    name_claims.check_unclaimed()  # one line naming the other ColdSnap plugin, before anything is registered
    register_recipe_item(KEY, RecipeItem(), owner=OWNER, execution_strategy=Strategy())
    register_hardware_probe(OWNER, script=PROBE_SCRIPT, enrich=add_cpu_accelerator)
    cpu_platform.register()
    lifecycle_provider.register()
    register_cli_command(_cli_loader, name=KEY)
