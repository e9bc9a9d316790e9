"""``setup --docker``'s CRIU for runc: a root-owned host-wide copy of the private CRIU, not a
program in one user's home, found by runc on PATH and made again only when it changed."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from sparkrun_coldsnap import doctor
from sparkrun_coldsnap.criu import tool as criu_tool
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.setup import criu_host_copy, docker_install


@pytest.fixture
def runc_path(tmp_path, monkeypatch, criu):
    """The wrapper and the host-wide prefix under *tmp_path*, the wrapper's folder first on PATH,
    and a home holding a copy of this machine's private CRIU (``setup --criu`` unpacked it)."""
    real = settings_mod.Settings.from_environ().home / "criu"
    assert criu_tool.private_argv(real) is not None, "no private CRIU at %s: run `sparkrun-coldsnap setup --criu`" % real
    home = tmp_path / "home-a"
    shutil.copytree(real, home / "criu", symlinks=True)
    sbin, host = tmp_path / "sbin", tmp_path / "lib" / "criu"
    monkeypatch.setattr(docker_install, "CRIU_WRAPPER", sbin / "criu")
    monkeypatch.setattr(docker_install, "CRIU_HOST_PREFIX", host)
    monkeypatch.setattr(criu_tool, "HOST_PREFIX", host)
    monkeypatch.setattr(criu_tool, "DPKG_LIST", tmp_path / "criu.list")
    monkeypatch.setenv("PATH", os.pathsep.join([str(sbin), "/usr/bin", "/bin"]))
    return home, sbin / "criu", host


def test_runc_gets_a_root_owned_copy_that_outlives_the_home_it_came_from(runc_path, use_settings):
    home, wrapper, host = runc_path
    use_settings(home=home)
    said: list[str] = []
    docker_install.criu_for_runc(said.append)

    assert len(said) == 1 and str(host) in said[0] and str(home / "criu") in said[0]
    assert str(home) not in wrapper.read_text() and str(host) in wrapper.read_text()
    for p in (host, *host.rglob("*")):
        if not p.is_symlink():
            assert p.lstat().st_uid == 0 and not p.lstat().st_mode & 0o022, p
    first = criu_tool.for_runc()
    assert first is not None and first.source == "wrapper" and first.usable and first.argv == criu_tool.private_argv(host)
    assert criu_tool.parse_version("Version: %s" % first.version) >= criu_tool.MIN_VERSION  # type: ignore[operator]

    moved = home.with_name("home-b")
    home.rename(moved)  # the home that ran the set-up moves (or another user's docker runs it)
    first = criu_tool.for_runc()
    assert first is not None and first.usable, first.problem
    use_settings(home=moved)
    assert doctor._wrapper_check(first).status == "ok"


def test_setup_again_changes_nothing_until_the_private_criu_changes(runc_path, use_settings):
    home, wrapper, host = runc_path
    use_settings(home=home)
    docker_install.criu_for_runc(lambda line: None)
    before = (wrapper.stat().st_mtime_ns, host.stat().st_ino)

    said: list[str] = []
    docker_install.criu_for_runc(said.append)
    assert said == [] and (wrapper.stat().st_mtime_ns, host.stat().st_ino) == before

    (home / "criu" / "etc" / "criu-upgraded").write_text("4.2.2\n")  # a later setup --criu
    docker_install.criu_for_runc(said.append)
    assert len(said) == 1 and (host / "etc" / "criu-upgraded").read_text() == "4.2.2\n"
    assert not list(host.parent.glob(".criu.*"))  # no staging or old copy left beside it
    assert [p.name for p in wrapper.parent.iterdir()] == ["criu"]  # nor a staged wrapper


def test_a_link_out_of_the_private_prefix_is_refused(tmp_path):
    prefix = tmp_path / "criu"
    (prefix / "usr" / "sbin").mkdir(parents=True)
    (prefix / "usr" / "sbin" / "criu").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ToolError, match="links to .*outside"):
        criu_host_copy.install(prefix, tmp_path / "host")
    assert not (tmp_path / "host").exists()


def test_the_copy_keeps_modes_without_group_or_other_write(tmp_path):
    prefix = tmp_path / "criu"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "tool").write_text("x")
    (prefix / "bin" / "tool").chmod(0o777)
    assert criu_host_copy.install(prefix, tmp_path / "host")
    assert stat.S_IMODE((tmp_path / "host" / "bin" / "tool").stat().st_mode) == 0o755
    assert not criu_host_copy.install(prefix, tmp_path / "host")
