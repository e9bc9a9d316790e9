"""iptables for a workload on several hosts (CRIU's network lock, the peer lock): ``setup``
installs it with apt without upgrading anything, ``doctor`` checks it with the fix in one line,
a capture refuses before any engine starts when a host lacks it (the host's answer to the
capture facts, over the real wire), and a restore's admission on such a host says so."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes.fake_unit_hosts import FakeUnitHosts, NoRecords
from helpers import FINGERPRINT

from sparkrun_coldsnap import doctor
from sparkrun_coldsnap.controller.capture_hosts import HostsCapture
from sparkrun_coldsnap.documents.capsule_ref import CapsuleRef
from sparkrun_coldsnap.documents.request import CaptureRequest, Launch, LaunchUnit, ModelRef, Topology, ValidationSpec, Workload
from sparkrun_coldsnap.errors import CaptureError, ToolError
from sparkrun_coldsnap.host import netfilter
from sparkrun_coldsnap.setup import debian_packages
from sparkrun_coldsnap.units import steps as s
from sparkrun_coldsnap.units.local import LocalHost


def executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def bare_path(tmp_path, monkeypatch) -> Path:
    """PATH of an empty folder of the test's only (for fake tools, which name what they run by path):
    no iptables, no apt-get."""
    fake = tmp_path / "bin"
    fake.mkdir()
    monkeypatch.setenv("PATH", str(fake))
    assert netfilter.missing() == ["iptables", "iptables-restore"]
    return fake


def test_doctor_warns_without_iptables_with_the_fix_and_is_content_with_it(bare_path):
    check = doctor.iptables_check()
    assert (check.name, check.status, check.fix) == ("iptables", "warn", "sparkrun coldsnap setup --iptables")
    assert check.detail.startswith("iptables, iptables-restore not found: a capture or restore across hosts refuses") and "\n" not in check.detail
    for tool in netfilter.TOOLS:
        executable(bare_path / tool)
    check = doctor.iptables_check()
    assert (check.status, check.fix) == ("ok", "") and str(bare_path / "iptables") in check.detail


APT = """#!/bin/sh
echo "$*" >> {log}
case "$*" in
  *install*) for t in iptables iptables-restore; do printf '#!/bin/sh\\n' > {bin}/$t; /bin/chmod 755 {bin}/$t; done ;;
esac
"""


def test_setup_installs_iptables_with_apt_without_upgrading_anything(bare_path, tmp_path):
    log = tmp_path / "apt.log"
    executable(bare_path / "apt-get", APT.format(log=log, bin=bare_path))
    said: list[str] = []
    debian_packages.ensure_iptables(said.append)
    assert log.read_text().splitlines() == ["install -y -q --no-upgrade iptables"]
    assert said == ["installing iptables", "iptables ready (%s)" % (bare_path / "iptables")]
    debian_packages.ensure_iptables(said.append)  # there now: apt is not asked again
    assert len(log.read_text().splitlines()) == 1


def test_setup_without_apt_names_the_package_to_install(bare_path):
    with pytest.raises(ToolError, match="^no apt-get on this host: install iptables with its package manager$"):
        debian_packages.ensure_iptables(lambda _: None)


def test_a_restore_across_hosts_names_what_the_host_lacks_and_the_fix(bare_path):
    (problem,) = netfilter.problems("a restore across hosts")
    assert problem == ("this host lacks iptables, iptables-restore, which a restore across hosts runs (CRIU's network lock holds each connection to another host with it): run `sparkrun coldsnap setup --iptables` here")
    for tool in netfilter.TOOLS:
        executable(bare_path / tool)
    assert netfilter.problems("a restore across hosts") == []


class FactsHost(LocalHost):
    """A FAKE host's answer to the capture facts: the driver can capture, iptables as *missing* says."""

    def __init__(self, missing: tuple[str, ...]) -> None:
        super().__init__(NoRecords())
        self.missing = missing

    def capture_facts(self, step: s.CaptureFactsStep) -> s.CaptureFactsAnswer:
        return s.CaptureFactsAnswer(supported=True, reason="", fingerprint=FINGERPRINT, missing_tools=self.missing)


class Hosts(FakeUnitHosts):
    def __init__(self, lacking: dict[str, tuple[str, ...]]) -> None:
        super().__init__()
        self.lacking = lacking

    def host(self, unit: LaunchUnit) -> LocalHost:
        return FactsHost(self.lacking.get(unit.host, ()))


def capturing() -> SimpleNamespace:
    units = (LaunchUnit(name="rank-0", host="198.18.0.1", rank=0), LaunchUnit(name="rank-1", host="198.18.0.2", rank=1))
    workload = Workload(
        recipe="two", engine="vllm", runtime="vllm-distributed", model=ModelRef(id="test/model", revision="ab" * 20),
        topology=Topology(hosts=tuple(u.host for u in units), tensor_parallel=2, units=units),
        launch=Launch(executor="local", command="vllm serve m", port=8000), driver="cpu",
    )  # fmt: skip
    req = CaptureRequest(workload=workload, validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="two"), ready_timeout_seconds=60)
    return SimpleNamespace(req=req, r=SimpleNamespace(driver=SimpleNamespace(name="cpu")))


def test_a_capture_refuses_before_any_engine_starts_naming_each_host_without_iptables_and_the_fix():
    c = capturing()
    hosts = Hosts({"198.18.0.2": ("iptables", "iptables-restore")})
    capture = HostsCapture(hosts, init_port=25000)
    capture.units = list(c.req.workload.topology.units)
    with pytest.raises(CaptureError) as err:
        capture._capture_facts(c)  # type: ignore[arg-type]
    assert err.value.message == (
        "host 198.18.0.2 (unit rank-1) lacks iptables, iptables-restore, which a capture across hosts runs (CRIU's network lock holds each connection to another host with it): run `sparkrun coldsnap setup --iptables` on every host"
    )
    assert [v for v, _ in hosts.log] == ["capture_facts", "capture_facts"]  # asked of every host, nothing started

    hosts = Hosts({})
    capture = HostsCapture(hosts, init_port=25000)
    capture.units = list(c.req.workload.topology.units)
    assert capture._capture_facts(c) == FINGERPRINT  # type: ignore[arg-type]
