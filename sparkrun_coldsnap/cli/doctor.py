"""``sparkrun coldsnap doctor``: what this host can do and what is missing."""

from __future__ import annotations

import click

from sparkrun_coldsnap.cli.common import emit_json

MARK = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def doctor(as_json):
    """Check sparkrun, the plugin's state, CRIU, GPU driver features and engines; say how to fix each gap."""
    from sparkrun_coldsnap.doctor import as_json as to_json
    from sparkrun_coldsnap.doctor import run_checks

    checks = run_checks()
    if as_json:
        emit_json(to_json(checks))
    else:
        for c in checks:
            click.echo("[%s] %-22s %s" % (MARK[c.status], c.name, c.detail))
            if c.fix:
                click.echo("       %-22s fix: %s" % ("", c.fix))
    if any(c.status == "fail" for c in checks):
        raise click.exceptions.Exit(1)


COMMANDS = [doctor]
