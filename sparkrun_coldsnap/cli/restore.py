"""``sparkrun coldsnap restore RECIPE``: ``sparkrun run`` that insists on the capsule."""

from __future__ import annotations

from pathlib import Path

import click

from sparkrun_coldsnap.cli.common import check_recipe_file, host_tuple, parse_overrides, store_option, target_options
from sparkrun_coldsnap.errors import ColdsnapError


@click.command("restore")
@click.argument("recipe")
@target_options
@store_option
@click.option("--receipt", "receipt_file", type=click.Path(path_type=Path), default=None, help="Write the receipt here (default: beside the capsule).")
@click.option("--dry-run", is_flag=True, help="Show what would happen; change nothing.")
def restore(recipe, hosts, cluster, options, offline, store, receipt_file, dry_run):
    """Restore RECIPE from its capsule and hand it to sparkrun (fails if there is no capsule).

    Like `sparkrun run RECIPE` for a recipe with a coldsnap: block, except that
    a missing capsule is an error instead of a vanilla start.
    """
    from sparkrun_coldsnap.integration import planning

    check_recipe_file(recipe)
    rc = planning.run_recipe(
        recipe,
        hosts=host_tuple(hosts),
        cluster=cluster,
        overrides=parse_overrides(options),
        offline=offline,
        require_capsule=True,
        receipt=str(receipt_file) if receipt_file else None,
        store=str(store) if store else None,
        dry_run=dry_run,
    )
    if rc != 0:
        raise ColdsnapError("restore of %s ended with exit status %d" % (recipe, rc))


COMMANDS = [restore]
