"""``sparkrun coldsnap capabilities``: engines, drivers and formats, machine-readable with --json."""

from __future__ import annotations

import click

from sparkrun_coldsnap.cli.common import emit_json


@click.command("capabilities")
@click.option("--json", "as_json", is_flag=True, help="Print the capabilities document (docs/schemas/capabilities.schema.json).")
def capabilities(as_json):
    """What this install supports: engines, snapshot drivers, formats, and what runs on this host."""
    from sparkrun_coldsnap.capabilities import collect

    caps = collect()
    if as_json:
        emit_json(caps.model_dump(mode="json"))
        return
    click.echo("sparkrun-coldsnap %s (sparkrun %s)" % (caps.tool_version, caps.sparkrun_version))
    for e in caps.engines:
        click.echo("engine %-7s runtimes %s; weights cpu: %s, gpu: %s" % (e.name, ", ".join(e.runtimes), _paths(e.weight_paths, "cpu"), _paths(e.weight_paths, "gpu")))
    for d in caps.drivers:
        click.echo("driver %-5s %s here; %s" % (d.name, "available" if d.available_here else "not available", d.reason))
    for u in caps.launchers:
        click.echo("launch %-6s %s; %s here: %s" % (u.executor, u.summary, "available" if u.available_here else "not available", u.reason))
    f = caps.formats
    click.echo("formats: request %d, capsule config %d, receipt %d, capabilities %d; artifact type %s" % (f.request, f.capsule_config, f.receipt, f.capabilities, f.artifact_type))


def _paths(weight_paths: dict, platform: str) -> str:
    return ", ".join(weight_paths.get(platform, ())) or "not supported (the engine has no %s build)" % platform.upper()


COMMANDS = [capabilities]
