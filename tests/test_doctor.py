"""What doctor and capabilities say about CRIU, Docker and the launch paths, against real files on PATH."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from sparkrun_coldsnap import doctor
from sparkrun_coldsnap.cli import coldsnap_group
from sparkrun_coldsnap.criu import tool as criu_tool


def fake_criu(path: Path, version: str) -> Path:
    """An executable that answers ``--version`` as CRIU does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho 'Version: %s'\n" % version)
    path.chmod(0o755)
    return path


@pytest.fixture
def path_with(tmp_path, monkeypatch):
    """PATH made of the given directories only (plus /bin and /usr/bin for sh and echo)."""

    def use(*dirs: Path) -> None:
        monkeypatch.setenv("PATH", os.pathsep.join([*map(str, dirs), "/usr/bin", "/bin"]))
        monkeypatch.setattr(criu_tool, "DPKG_LIST", tmp_path / "criu.list")

    return use


def test_the_runc_wrapper_is_recognized_and_never_taken_for_the_distributions_criu(criu, tmp_path, path_with):
    private = fake_criu(tmp_path / "home" / "criu" / "usr" / "sbin" / "criu", "4.2.1")
    old = fake_criu(tmp_path / "usr-sbin" / "criu", "3.17.1")
    (tmp_path / "criu.list").write_text("%s\n" % old)
    wrapper = tmp_path / "local-sbin" / "criu"
    wrapper.parent.mkdir()
    wrapper.write_text(criu_tool.wrapper_script([str(private)]))
    wrapper.chmod(0o755)
    path_with(wrapper.parent, old.parent)

    first = criu_tool.for_runc()
    assert first is not None and first.source == "wrapper" and first.argv == (str(private),) and first.usable
    by_source = {c.source: c for c in criu_tool.candidates()}
    assert by_source["distribution"].path == str(old) and not by_source["distribution"].usable
    assert "system" not in by_source  # the wrapper is not "the system criu"


def test_locating_criu_asks_no_candidate_after_the_first_usable_one(tmp_path, path_with, use_settings):
    use_settings(home=tmp_path / "home")  # no private CRIU there
    asked = tmp_path / "asked"

    def counting_criu(path: Path, version: str) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\necho %s >> %s\necho 'Version: %s'\n" % (path.parent.name, asked, version))
        path.chmod(0o755)
        return path

    old, system, later = (counting_criu(tmp_path / d / "criu", v) for d, v in (("old", "3.17.1"), ("system", "4.2.1"), ("later", "4.2.2")))
    path_with(old.parent, system.parent, later.parent)

    found = criu_tool.Criu.locate()
    assert found.argv == (str(system),) and found.version == "4.2.1"
    assert asked.read_text().split() == ["old", "system"]  # in PATH order, and nothing after the one used
    asked.unlink()
    assert [c.path for c in criu_tool.candidates()] == [str(old), str(system), str(later)]  # the full list still asks every one
    path_with(old.parent)
    with pytest.raises(criu_tool.ToolError, match=r"no usable CRIU >= 4.2 \(system: criu 3.17.1 is older than 4.2"):
        criu_tool.Criu.locate()


def test_the_files_of_every_criu_a_restore_may_run_are_found_without_running_one(tmp_path, path_with, use_settings, monkeypatch):
    use_settings(home=tmp_path / "home")
    prefix = tmp_path / "home" / "criu"
    libdir = prefix / "usr" / "lib" / criu_tool._multiarch()
    libdir.mkdir(parents=True)
    (prefix / "usr" / "sbin").mkdir()
    private = prefix / "usr" / "sbin" / "criu"
    private.write_text("never run\n")  # found by its place, not by asking it its version
    for name in (criu_tool._loader_name(), "libc.so.6", "libprotobuf-c.so.1.0.0"):
        (libdir / name).write_bytes(b"\x7fELF")
    (libdir / "libprotobuf-c.so.1").symlink_to("libprotobuf-c.so.1.0.0")  # read once, through its target
    (libdir / "gconv").mkdir()
    system = fake_criu(tmp_path / "sbin" / "criu", "4.2.1")
    path_with(system.parent)
    plugins = tmp_path / "lib-criu"
    (plugins / "scripts").mkdir(parents=True)
    (plugins / "cuda_plugin.so").write_bytes(b"\x7fELF")  # loaded by CRIU at every run
    (plugins / "scripts" / "restart.sh").write_text("#!/bin/sh\n")  # not a plugin
    monkeypatch.setattr(criu_tool, "PLUGIN_DIR", plugins)

    found = set(criu_tool.program_files())
    assert found == {system.resolve(), private, plugins / "cuda_plugin.so", *(libdir / n for n in (criu_tool._loader_name(), "libc.so.6", "libprotobuf-c.so.1.0.0"))}


def test_doctor_says_which_private_criu_the_wrapper_runs_and_whose(tmp_path, path_with, use_settings):
    other_home = fake_criu(tmp_path / "other-home" / "criu" / "usr" / "sbin" / "criu", "4.2.1")
    wrapper = tmp_path / "local-sbin" / "criu"
    wrapper.parent.mkdir()
    wrapper.write_text(criu_tool.wrapper_script([str(other_home)]))
    wrapper.chmod(0o755)
    path_with(wrapper.parent)
    use_settings(home=tmp_path / "this-home")  # this home has no private CRIU

    checks = {c.name: c for c in doctor._criu()}
    w = checks["criu (runc wrapper)"]
    assert w.status == "warn" and "it runs the private criu 4.2.1 at %s" % other_home in w.detail and "another home directory" in w.detail
    assert checks["criu (distribution)"].detail.startswith("no criu package installed")


def test_capabilities_has_a_row_per_launch_path_and_no_empty_weights_value(docker_daemon, criu, tmp_path):
    result = CliRunner().invoke(coldsnap_group, ["capabilities"], catch_exceptions=False)
    assert result.exit_code == 0
    lines = result.output.splitlines()
    sglang = next(l for l in lines if l.startswith("engine sglang"))
    assert "weights cpu: not supported" in sglang and "cpu: ," not in sglang
    assert any(l.startswith("launch local ") for l in lines) and any(l.startswith("launch docker ") for l in lines)
