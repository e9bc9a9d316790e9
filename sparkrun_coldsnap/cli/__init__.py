"""The ``sparkrun coldsnap`` command group (also installed as ``sparkrun-coldsnap``).

Errors are caught in one place, here: one line on stderr, a non-zero exit,
and a traceback only with ``--debug`` (or ``COLDSNAP_DEBUG=1``).
"""

from __future__ import annotations

import logging
import os
import sys

import click

from sparkrun_coldsnap.errors import ColdsnapError


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        debug = bool(os.environ.get("COLDSNAP_DEBUG")) or (ctx.params or {}).get("debug")
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except ColdsnapError as err:
            if debug:
                raise
            click.echo("Error: %s" % err.message, err=True)
            ctx.exit(err.exit_code)
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            ctx.exit(130)
        except Exception as err:  # noqa: BLE001 - sparkrun's own errors, one line too
            if debug:
                raise
            text = str(err).strip().splitlines()
            click.echo("Error: %s" % (text[0] if text else type(err).__name__), err=True)
            ctx.exit(1)


@click.group("coldsnap", cls=_Group)
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
def coldsnap_group(debug: bool) -> None:
    """Capture an initialized inference workload once; restore it in seconds."""
    if debug or os.environ.get("COLDSNAP_DEBUG"):
        os.environ["COLDSNAP_DEBUG"] = "1"
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)


def _register_verbs() -> None:
    from sparkrun_coldsnap.cli import bench, capabilities, capture, doctor, registry_verbs, restore, setup, store_verbs

    for module in (capture, restore, store_verbs, registry_verbs, capabilities, doctor, bench, setup):
        for cmd in module.COMMANDS:
            coldsnap_group.add_command(cmd)


_register_verbs()


def main() -> None:
    """Standalone entry (works even while sparkrun has the plugin disabled)."""
    coldsnap_group(prog_name="sparkrun-coldsnap")
