"""The ``sparkrun coldsnap`` command group (also installed as ``sparkrun-coldsnap``).

Errors are caught in one place, here: one line on stderr, a non-zero exit,
and a traceback only with ``--debug`` (or ``COLDSNAP_DEBUG=1``); the traceback of an
unexpected error is kept in a log file the message names.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path

import click

from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.errors import ColdsnapError, coldsnap_cause
from sparkrun_coldsnap.host import interrupts


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        # The entry: the settings are read here, once, and carried from here on.
        try:
            settings = settings_mod.install(settings_mod.Settings.from_environ())
        except ColdsnapError as err:  # a setting that cannot be read: nothing else can run
            click.echo("Error: %s" % err.message, err=True)
            ctx.exit(err.exit_code)
        if (ctx.params or {}).get("debug"):
            _debug_on()
        try:
            # SIGTERM unwinds a verb as Ctrl-C does: what it started is stopped, its staging dropped.
            with interrupts.as_interrupt():
                return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except ColdsnapError as err:
            settings = settings_mod.current()  # --debug after the verb turned it on since
            if settings.debug:
                raise
            click.echo("Error: %s" % err.message, err=True)
            ctx.exit(err.exit_code)
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            ctx.exit(130)
        except Exception as err:  # noqa: BLE001 - sparkrun's own errors and our bugs, one line too
            settings = settings_mod.current()
            if settings.debug:
                raise
            ours = coldsnap_cause(err)
            if ours is not None:  # ours, wrapped by sparkrun: its own line and exit code, no wrapper sentence
                click.echo("Error: %s" % ours.message, err=True)
                ctx.exit(ours.exit_code)
            text = str(err).strip().splitlines()
            where = write_traceback(err)
            click.echo("Error: %s%s" % (text[0] if text else type(err).__name__, " (traceback: %s)" % where if where else ""), err=True)
            ctx.exit(1)


def write_traceback(err: BaseException) -> Path | None:
    """Keep an unexpected error's traceback in a log file the one-line message names."""
    from sparkrun_coldsnap.host import paths

    try:
        path = paths.run_dir() / "logs" / ("error-%s-%d.log" % (time.strftime("%Y%m%dT%H%M%S"), os.getpid()))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(err)))
        return path
    except OSError:
        return None


DEBUG_HELP = "Show tracebacks and debug logs (before or after the verb; or COLDSNAP_DEBUG=1)."


def _debug_on() -> None:
    settings = settings_mod.current()
    if not settings.debug:
        settings_mod.install(settings.replace(debug=True))
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)


def _debug_flag(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        _debug_on()


@click.group("coldsnap", cls=_Group)
@click.option("--debug", is_flag=True, help=DEBUG_HELP)
def coldsnap_group(debug: bool) -> None:
    """Capture an initialized inference workload once; restore it in seconds."""
    if settings_mod.current().debug:
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)


def _register_verbs() -> None:
    from sparkrun_coldsnap.cli import bench, capabilities, capture, doctor, encrypt_verbs, lifecycle, registry_verbs, restore, setup, signing_verbs, store_verbs

    for module in (capture, restore, lifecycle, store_verbs, registry_verbs, signing_verbs, encrypt_verbs, capabilities, doctor, bench, setup):
        for cmd in module.COMMANDS:
            # --debug is accepted after the verb too, where users type it.
            cmd.params.append(click.Option(["--debug"], is_flag=True, expose_value=False, is_eager=True, callback=_debug_flag, help=DEBUG_HELP))
            coldsnap_group.add_command(cmd)


_register_verbs()


def main() -> None:
    """Standalone entry (works even while sparkrun has the plugin disabled)."""
    coldsnap_group(prog_name="sparkrun-coldsnap")
