"""The collectives of a workload on several hosts are bound to the interface holding the address
sparkrun placed each rank at, found on the rank's host over the real wire (FAKE hosts that are
this machine, ``fakes/fake_unit_hosts.py``); a recipe's own setting wins, and a host where no
interface holds the address is refused before any engine starts, naming the setting."""

from __future__ import annotations

import socket

import psutil
import pytest
from fakes.fake_unit_hosts import FakeUnitHosts

from sparkrun_coldsnap.controller import socket_ifnames
from sparkrun_coldsnap.controller.ranks import start_ranks
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
from sparkrun_coldsnap.documents.request import Launch, LaunchUnit, ModelRef, Topology, Workload
from sparkrun_coldsnap.errors import RequestError
from sparkrun_coldsnap.host.socket_iface import interface_holding
from sparkrun_coldsnap.progress import QUIET

UNASSIGNED = "198.51.100.77"  # TEST-NET-2: held by no interface of any machine


def own_interface() -> tuple[str, str]:
    """A non-loopback interface of this machine with an IPv4 address: (name, address)."""
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return name, a.address
    pytest.fail("this machine has no IPv4 address outside loopback")


def rb() -> ReceiptBuilder:
    return ReceiptBuilder("capture", request_sha256="sha256:" + "0" * 64)


class Hosts(FakeUnitHosts):
    """FAKE hosts that record what each unit would have been started with."""

    def __init__(self) -> None:
        super().__init__()
        self.started: dict[str, dict[str, str]] = {}

    def start(self, unit: LaunchUnit, command: str, env: dict[str, str]) -> None:
        self.started[unit.name] = env

    def wait_rendezvous(self, head: LaunchUnit, port: int) -> float:
        return 0.0


def units(*hosts: str) -> list[LaunchUnit]:
    return [LaunchUnit(name="rank-%d" % i, host=h, rank=i) for i, h in enumerate(hosts)]


def launches(us: list[LaunchUnit], **env: str) -> dict[str, tuple[str, dict[str, str]]]:
    return {u.name: ("vllm serve m", {"HF_HUB_OFFLINE": "1", **env}) for u in us}


def test_the_interface_holding_an_address_is_found_on_the_host_and_none_holds_an_unassigned_one():
    name, address = own_interface()
    assert interface_holding(address) == name
    assert interface_holding("127.0.0.1") == "lo"
    assert interface_holding(UNASSIGNED) is None


def test_a_name_resolving_only_to_loopback_falls_back_to_the_address_the_ssh_session_came_in_at():
    name, address = own_interface()
    # "localhost" resolves to loopback only (Debian maps a host's own name the same way): not
    # an address other hosts reach; the address sparkrun's SSH session arrived at is.
    assert interface_holding("localhost") is None
    assert interface_holding("localhost", ssh_connection="192.0.2.200 50000 %s 22" % address) == name
    assert interface_holding("localhost", ssh_connection="192.0.2.200 50000 %s 22" % UNASSIGNED) is None
    assert interface_holding(UNASSIGNED, ssh_connection="192.0.2.200 50000 %s 22" % address) is None  # an address is taken as it is


def test_each_unit_gets_the_interface_holding_its_placed_address_and_nccl_only_over_sockets():
    name, address = own_interface()
    us = units("127.0.0.1", address)
    hosts, receipt = Hosts(), rb()
    out = socket_ifnames.pinned(us, hosts, launches(us), receipt)
    assert out["rank-0"][1] == {"HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    assert out["rank-1"][1] == {"HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": name}
    assert [v for v, _ in hosts.log] == ["socket_interface", "socket_interface"]
    assert receipt.details["socket_interfaces"] == {"rank-0": "lo", "rank-1": name}

    # A driver of several GPU ranks sends NCCL over sockets across hosts: NCCL binds to it too.
    out = socket_ifnames.pinned(us, Hosts(), launches(us, NCCL_NET="Socket"), rb())
    assert out["rank-1"][1]["NCCL_SOCKET_IFNAME"] == name and out["rank-1"][1]["GLOO_SOCKET_IFNAME"] == name


def test_a_setting_the_recipe_names_wins_and_its_host_is_not_asked():
    _, address = own_interface()
    us = units("127.0.0.1", address)
    hosts, receipt = Hosts(), rb()
    given = launches(us, GLOO_SOCKET_IFNAME="eth9")
    out = socket_ifnames.pinned(us, hosts, given, receipt)
    assert out == given and hosts.log == [] and "socket_interfaces" not in receipt.details
    # One named, the other derived.
    out = socket_ifnames.pinned(us, Hosts(), launches(us, NCCL_NET="Socket", NCCL_SOCKET_IFNAME="ib0"), rb())
    assert out["rank-0"][1]["NCCL_SOCKET_IFNAME"] == "ib0" and out["rank-0"][1]["GLOO_SOCKET_IFNAME"] == "lo"


def test_one_unit_is_left_as_it_is():
    us = units(UNASSIGNED)
    hosts = Hosts()
    assert socket_ifnames.pinned(us, hosts, launches(us), rb()) == launches(us) and hosts.log == []


def test_a_host_where_no_interface_holds_its_address_is_refused_in_one_line_naming_the_setting():
    us = units("127.0.0.1", UNASSIGNED)
    with pytest.raises(RequestError) as err:
        socket_ifnames.pinned(us, Hosts(), launches(us), rb())
    message = err.value.message
    assert message.startswith("no network interface of host %s (unit rank-1) holds the address sparkrun placed its rank at" % UNASSIGNED), message
    assert "set GLOO_SOCKET_IFNAME in the recipe's env" in message and "\n" not in message and "127.0.0.1" not in message


def workload(*hosts: str, **env: str) -> Workload:
    us = units(*hosts)
    return Workload(
        recipe="two", engine="vllm", runtime="vllm-distributed", model=ModelRef(id="test/model", revision="ab" * 20),
        topology=Topology(hosts=hosts, tensor_parallel=2, units=tuple(us)),
        launch=Launch(executor="local", command="vllm serve m", env=dict(env), port=8000), driver="cpu",
    )  # fmt: skip


def test_every_start_of_several_units_binds_them_before_the_head_starts_and_a_refusal_starts_none():
    name, address = own_interface()
    hosts = Hosts()
    start_ranks(workload("127.0.0.1", address), hosts, rb(), QUIET, init_port=25000)
    assert hosts.started == {"rank-0": {"GLOO_SOCKET_IFNAME": "lo"}, "rank-1": {"GLOO_SOCKET_IFNAME": name}}
    assert [v for v, _ in hosts.log] == ["socket_interface", "socket_interface"]  # both asked before any start

    hosts = Hosts()
    with pytest.raises(RequestError, match="GLOO_SOCKET_IFNAME"):
        start_ranks(workload("127.0.0.1", UNASSIGNED), hosts, rb(), QUIET, init_port=25000)
    assert hosts.started == {}

    hosts = Hosts()
    start_ranks(workload("127.0.0.1", UNASSIGNED, GLOO_SOCKET_IFNAME="eth0"), hosts, rb(), QUIET, init_port=25000)  # the recipe's own
    assert hosts.started == {"rank-0": {"GLOO_SOCKET_IFNAME": "eth0"}, "rank-1": {"GLOO_SOCKET_IFNAME": "eth0"}} and hosts.log == []
