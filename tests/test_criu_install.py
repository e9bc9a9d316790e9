"""The CRIU installer where the user is: Debian or Ubuntu, amd64 or arm64.

The arm64 private install is checked for real on this amd64 machine: Debian's arm64
packages downloaded with private package lists (the host's apt left as it was), every
ELF file of the prefix built for AArch64, and the unpacked criu run under qemu's user mode.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from sparkrun_coldsnap.criu import tool as criu_tool
from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.setup import criu_install

# An Ubuntu 24.04 (DGX OS) host's apt sources: its own archive, no Debian one.
UBUNTU_SOURCES = """Types: deb
URIs: http://mirror.example/ubuntu-ports/
Suites: noble noble-updates noble-backports
Components: main restricted universe multiverse
Signed-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg
"""
DEBIAN_SOURCES = """Types: deb
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
"""


def apt_state() -> tuple[str, list[str]]:
    """The host's foreign architectures and the package lists apt holds: what the install must not change."""
    foreign = subprocess.run(["dpkg", "--print-foreign-architectures"], capture_output=True, text=True, check=True).stdout
    return foreign, sorted(p.name for p in Path("/var/lib/apt/lists").glob("*Packages*"))


def elf_machines(root: Path) -> dict[str, list[Path]]:
    """Every ELF file under *root* (links not followed), by the machine it was built for."""
    out: dict[str, list[Path]] = {}
    for path in root.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        with path.open("rb") as f:
            if f.read(4) != b"\x7fELF":
                continue
            f.seek(0)
            out.setdefault(ELFFile(f).header["e_machine"], []).append(path)
    return out


def test_the_arm64_private_install_holds_only_aarch64_programs_and_its_criu_runs_under_qemu(criu, tmp_path):
    before = apt_state()
    prefix = tmp_path / "home" / "criu"
    lines: list[str] = []
    said = criu_install.ensure(prefix, arch="arm64", log=lines.append)

    version = said.split()[1]
    assert criu_tool.parse_version("Version: %s" % version)[:2] >= criu_tool.MIN_VERSION
    assert said.startswith("criu %s ready: Debian's arm64 packages unpacked into %s (" % (version, prefix)) and "\n" not in said
    if criu_install.deb_arch() == "amd64":  # CI's machine: the arm64 packages are another architecture's
        assert said.endswith("(for arm64, not this amd64 host: the distribution's criu does not apply)")
    debs = sorted((tmp_path / "home" / "criu-debs" / "arm64").glob("*.deb"))
    assert len(debs) == len(criu_install.FROM_SID) + len(criu_install.FROM_TRIXIE)
    assert all(d.name.endswith(("_arm64.deb", "_all.deb")) for d in debs), [d.name for d in debs]
    machines = elf_machines(prefix)
    assert set(machines) == {"EM_AARCH64"}, {m: [str(p) for p in ps[:3]] for m, ps in machines.items()}
    assert len(machines["EM_AARCH64"]) > 20  # criu, its loader, libc and the libraries it links

    argv = criu_tool.private_argv(prefix, "aarch64")
    assert argv is not None and argv[0].endswith("/usr/lib/aarch64-linux-gnu/ld-linux-aarch64.so.1")
    assert criu_tool.private_argv(prefix, "x86_64") is None  # nothing of amd64's layout is there
    out = subprocess.run([*criu_install.emulator("aarch64"), *argv, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Version: %s" % version in out.stdout, out.stdout + out.stderr
    assert any("arm64 package lists" in line for line in lines), lines
    assert apt_state() == before  # no foreign architecture added, no package list of the host's apt changed


def test_carried_packages_of_another_architecture_are_refused_naming_the_package(tmp_path):
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text("Package: criu\nVersion: 4.2.1-1\nArchitecture: amd64\nMaintainer: none <none@example.invalid>\nDescription: test\n")
    carried = tmp_path / "debs"
    carried.mkdir()
    deb = carried / "criu_4.2.1-1_amd64.deb"
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(root), str(deb)], check=True, capture_output=True)

    with pytest.raises(ToolError, match=r"criu_4\.2\.1-1_amd64\.deb is a package for amd64, this host is arm64: pass --criu-debs with the arm64 packages"):
        criu_install.install(tmp_path / "prefix", debs_dir=carried, arch="arm64", log=lambda _: None)
    assert not (tmp_path / "prefix").exists()


def test_an_ubuntu_host_is_told_how_to_name_a_debian_archive_and_a_debian_host_uses_its_own(tmp_path):
    ubuntu = tmp_path / "ubuntu"
    (ubuntu / "sources.list.d").mkdir(parents=True)
    (ubuntu / "sources.list.d" / "ubuntu.sources").write_text(UBUNTU_SOURCES)
    with pytest.raises(ToolError, match="no Debian mirror in the apt sources under %s .*: for CRIU pass --criu-mirror URL of a Debian archive, or --criu-debs DIR" % ubuntu):
        criu_install.debian_mirror(ubuntu)
    debian = tmp_path / "debian"
    (debian / "sources.list.d").mkdir(parents=True)
    (debian / "sources.list.d" / "debian.sources").write_text(DEBIAN_SOURCES)
    assert criu_install.debian_mirror(debian) == "http://mirror.example/debian"


@pytest.mark.parametrize(
    "candidate, enough",
    [("4.2.1-1", True), ("1:4.3-2ubuntu1", True), ("4.2~rc1-1", False), ("4.3~rc1-1", True), ("4.1.1-2", False), ("3.17.1-2", False), (None, False), ("", False)],
)
def test_the_distributions_criu_is_installed_only_from_4_2(candidate, enough):
    assert criu_install.distribution_suffices(candidate) is enough


def test_architectures_map_between_uname_and_debian_and_an_unknown_one_is_one_line():
    assert criu_install.deb_arch("x86_64") == "amd64" and criu_install.deb_arch("aarch64") == "arm64"
    with pytest.raises(ToolError, match="no Debian packages of CRIU for a riscv64 machine .*install a criu >= 4.2 with the distribution's package manager"):
        criu_install.deb_arch("riscv64")
    with pytest.raises(ToolError, match="unknown architecture 'aarch64': use one of amd64, arm64"):
        criu_install.install(Path("/nonexistent/prefix"), arch="aarch64")
