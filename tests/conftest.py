"""Shared fixtures: real sparkrun with the plugin enabled in a private HOME.

sparkrun keeps its configuration and workload records under the home
directory, so every test gets its own HOME, copied from a template made once
per session with sparkrun's own commands (plugin enabled, local executor on,
docker executor off, unreachable recipe registries off). The engine, CRIU
and the tiny model come from ``$COLDSNAP_HOME`` and the Hugging Face cache,
as installed by ``scripts/setup.sh``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tier_fixtures

from sparkrun_coldsnap.documents import settings as settings_mod

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tiny-vllm-cpu.yaml"
BIN = Path(sys.executable).parent
REAL_HOME = Path(os.path.expanduser("~"))
REGISTRIES = ("eugr", "official", "sparkrun-transitional", "atlas", "community", "experimental", "sparkrun-testing")


def coldsnap_home() -> Path:
    env = os.environ.get("COLDSNAP_HOME")
    return Path(env) if env else REAL_HOME / ".local" / "share" / "sparkrun-coldsnap"


ENGINES = coldsnap_home() / "engines"


def hf_home() -> Path:
    env = os.environ.get("HF_HOME")
    return Path(env) if env else REAL_HOME / ".cache" / "huggingface"


def base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARKRUN_", "COLDSNAP_STORE"))}
    env.update(
        HOME=str(home),
        SPARKRUN_NO_TELEMETRY="1",
        COLDSNAP_HOME=str(coldsnap_home()),
        HF_HOME=str(hf_home()),
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Sparkrun:
    """sparkrun's own entry point, run as a user would, in a private HOME."""

    home: Path
    env: dict[str, str]

    def __call__(self, *args: str, check: bool = True, timeout: float = 900, input: str | None = None) -> subprocess.CompletedProcess:
        cp = subprocess.run([str(BIN / "sparkrun"), *args], env=self.env, capture_output=True, text=True, timeout=timeout, input=input, cwd=str(ROOT))
        if check and cp.returncode != 0:
            raise AssertionError("sparkrun %s failed (%d):\n%s\n%s" % (" ".join(args), cp.returncode, cp.stdout[-3000:], cp.stderr[-3000:]))
        return cp

    def popen(self, *args: str) -> subprocess.Popen:
        """sparkrun started with its output (stderr folded in) readable as it comes, and Ctrl-C's
        default: a suite started in the background of a shell ignores SIGINT, and a process
        that starts with it ignored keeps ignoring it, as a user's terminal would not."""
        return subprocess.Popen(
            [str(BIN / "sparkrun"), *args], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT), preexec_fn=_sigint_default,
        )  # fmt: skip

    def coldsnap(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self("coldsnap", *args, **kw)

    def json(self, *args: str) -> dict:
        return json.loads(self.coldsnap(*args).stdout)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's tier (fast, system, full) follows from the real parts its fixtures name
    (tests/tier_fixtures.py); ``-m fast`` selects the quick ones."""
    for item in items:
        by_hand = [t for t in tier_fixtures.TIERS if item.get_closest_marker(t)]
        if by_hand:
            raise pytest.UsageError("%s is marked %s by hand: a tier follows from the fixtures a test requests (tests/tier_fixtures.py)" % (item.nodeid, by_hand[0]))
        tier = tier_fixtures.tier_of(getattr(item, "fixturenames", ()), engine_marked=item.get_closest_marker("engine") is not None)
        item.add_marker(tier)
        item.stash[TIER] = tier
        assert [t for t in tier_fixtures.TIERS if item.get_closest_marker(t)] == [tier], item.nodeid


TIER = pytest.StashKey[str]()
#: where the tests' own fakes live (a fake ``criu`` a test writes is no real CRIU)
OWN_FAKES = (Path(__file__).resolve().parent, Path(tempfile.gettempdir()).resolve())


@contextlib.contextmanager
def _tier_guard(item: pytest.Item) -> Iterator[None]:
    tier = item.stash.get(TIER, "full")
    if tier == "full":
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        tier_fixtures.install(tier_fixtures.Guard(tier, ENGINES, OWN_FAKES), mp)
        yield


# While a test and its fixtures set up, and while it runs, starting a real part above the test's
# tier fails at once, naming the fixture to request (tests/tier_fixtures.py). Teardown is left
# unguarded: the session's fixtures (the two hosts) end in the teardown of whichever test ran
# last, whatever its tier, and a part being stopped is no part being started.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with _tier_guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _tier_guard(item):
        return (yield)


@pytest.fixture(scope="session")
def criu():
    """Real CRIU, located as the plugin locates it (scripts/setup.sh installs it)."""
    from sparkrun_coldsnap.criu.tool import Criu

    return Criu.locate()


@pytest.fixture(scope="session")
def oci_registry() -> str:
    """The real OCI registry's program (tests/registry_fixtures.py starts it)."""
    from registry_fixtures import BINARY

    if not Path(BINARY).is_file():
        pytest.fail("no OCI registry at %s: run `bash scripts/test.sh` (it installs Debian's docker-registry)" % BINARY)
    return BINARY


@pytest.fixture(scope="session")
def skopeo() -> str:
    """skopeo that signs and checks sigstore signatures (scripts/install_skopeo.sh provides it)."""
    from skopeo_fixtures import locate

    found = locate()
    if found is None:
        pytest.fail("no skopeo with sigstore signatures: run `bash scripts/test.sh` (scripts/install_skopeo.sh provides Debian 13's skopeo)")
    return found


@pytest.fixture(scope="session")
def docker_daemon() -> str | None:
    """The docker client; each docker test checks for the daemon and its images itself."""
    return shutil.which("docker")


@pytest.fixture(scope="session")
def vllm_engine() -> Path:
    """The real vllm-cpu engine environment and the tiny model (scripts/setup.sh installs both)."""
    require_engine()
    return ENGINES / "vllm-cpu"


@pytest.fixture(autouse=True)
def fresh_settings():
    """No test sees settings another installed: the first use in a test reads its environment."""
    settings_mod.forget()
    yield
    settings_mod.forget()


@pytest.fixture
def use_settings():
    """Plugin settings for code a test runs in-process: the environment's, with changes."""

    def use(**changes):
        return settings_mod.install(settings_mod.Settings.from_environ().replace(**changes))

    return use


@pytest.fixture
def lifecycle_home(tmp_path, use_settings, monkeypatch) -> Path:
    """A COLDSNAP_HOME of the test's own, for the lifecycle's records (in this process and its children)."""
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path / "home"))
    use_settings(home=tmp_path / "home")
    return tmp_path / "home"


def make_sparkrun_home(home: Path) -> Sparkrun:
    """A sparkrun home set up with sparkrun's own commands: the plugin enabled, the local
    executor on, the docker one off without a daemon, unreachable recipe registries off."""
    home.mkdir(parents=True, exist_ok=True)
    sr = Sparkrun(home, base_env(home))
    sr("plugins", "enable", "coldsnap")
    sr("setup", "features", "enable", "executor.local")
    # sparkrun's status probes every enabled executor; without a daemon the docker one fails.
    docker_up = subprocess.run(["docker", "info"], capture_output=True).returncode == 0 if shutil.which("docker") else False
    sr("setup", "features", "enable" if docker_up else "disable", "executor.docker")
    for name in REGISTRIES:
        sr("registry", "disable", name, check=False)
    from sparkrun_coldsnap.integration.registries import settle_pending_bootstrap

    settle_pending_bootstrap(home / ".config" / "sparkrun")  # as `setup` does on a host without internet
    return sr


@pytest.fixture(scope="session")
def template_home(tmp_path_factory) -> Path:
    return make_sparkrun_home(tmp_path_factory.mktemp("sparkrun-home-template")).home


@pytest.fixture
def sparkrun(template_home, tmp_path) -> Sparkrun:
    home = tmp_path / "home"
    shutil.copytree(template_home, home, symlinks=True)
    return Sparkrun(home, base_env(home))


@pytest.fixture
def store(tmp_path) -> Path:
    return tmp_path / "store"


def write_recipe(tmp_path: Path, *, coldsnap: str | None = None, replace: dict[str, str] | None = None, name: str = "tiny.yaml", source: Path = RECIPE) -> Path:
    """A copy of a project recipe (the embedded default unless told) with edits."""
    text = source.read_text()
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    if coldsnap is not None:
        text = text[: text.index("coldsnap:")] + coldsnap
    path = tmp_path / name
    path.write_text(text)
    return path


def require_engine() -> None:
    """Engine tests need what scripts/setup.sh installs; say so instead of skipping."""
    missing = []
    if not (coldsnap_home() / "engines" / "vllm-cpu" / "bin" / "python").exists():
        missing.append("the vllm-cpu engine environment")
    if not any((hf_home() / "hub").glob("models--coldsnap--tiny-qwen2/snapshots/*")):
        missing.append("the tiny model")
    if missing:
        pytest.fail("%s missing under %s: run `bash scripts/setup.sh` first" % (" and ".join(missing), coldsnap_home()))


@pytest.fixture(scope="session")
def two_hosts():
    """Two hosts made of network namespaces, each with its own sshd (tests/two_hosts.py).

    Sessions on them see the model cache and the plugin's engines where this machine has
    them, as a cluster with a shared filesystem would.
    """
    from two_hosts import TwoHosts

    with TwoHosts(shared_env={"HF_HOME": str(hf_home()), "COLDSNAP_HOME": str(coldsnap_home())}) as hosts:
        yield hosts


@pytest.fixture
def host_namespaces():
    """The two hosts' machinery (tests/two_hosts.py), for a test that makes and removes hosts itself."""
    from two_hosts import TwoHosts

    return TwoHosts


@pytest.fixture
def two_node(two_hosts, sparkrun):
    """sparkrun's cluster ``two-node`` of the two hosts, in this test's sparkrun home."""
    two_hosts.configure_sparkrun(sparkrun, "two-node")
    yield two_hosts
    sparkrun("cluster", "delete", "two-node", "--force")
