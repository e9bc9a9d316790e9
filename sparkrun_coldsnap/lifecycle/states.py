"""The lifecycle's states and the moves between them: one table, no side effects.

A workload the plugin manages is in one of five states:

* ``active``: serving;
* ``sleeping``: the engine released its accelerator memory in place (the process stays);
* ``hibernated``: captured into a capsule and stopped; host and accelerator memory are free;
* ``warm``: a restore prepared ahead (admitted, staged, weights read into the page cache; on
  GPU drivers the tree restored too, its engine asleep), waiting for ``wake`` or ``sparkrun
  run`` to activate it;
* ``failed``: a transition was interrupted and what it left could not be told apart; the
  record says what is known and what to run next.

While a verb runs, the record carries the transition (verb, from, to, the PID running it):
a second command sees it, and after a crash the next command settles it
(:mod:`sparkrun_coldsnap.lifecycle.settle`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sparkrun_coldsnap.errors import RequestError

State = Literal["active", "sleeping", "warm", "hibernated", "failed"]
Verb = Literal["sleep", "wake", "hibernate", "warm", "activate", "release"]
STATES: tuple[State, ...] = ("active", "sleeping", "warm", "hibernated", "failed")


@dataclass(frozen=True)
class Move:
    verb: Verb
    source: State
    target: State
    what: str  # for people: what the move does


#: Every allowed move. ``activate`` is ``sparkrun run`` of a warm or hibernated workload;
#: ``release`` drops a warm restore (``stop``, or its time ran out) and leaves the capsule.
MOVES: tuple[Move, ...] = (
    Move("sleep", "active", "sleeping", "the engine releases its accelerator memory in place"),
    Move("wake", "sleeping", "active", "the engine takes its memory back and is validated"),
    Move("hibernate", "active", "hibernated", "the live workload is captured into a capsule and stopped"),
    Move("wake", "hibernated", "active", "the hibernation capsule is restored and validated"),
    Move("warm", "hibernated", "warm", "the hibernation capsule is admitted and staged ahead"),
    Move("wake", "warm", "active", "the prepared restore is activated and validated"),
    Move("activate", "warm", "active", "sparkrun run activates the prepared restore"),
    Move("activate", "hibernated", "active", "sparkrun run restores the hibernation capsule"),
    Move("release", "warm", "hibernated", "the prepared restore is dropped; the capsule stays"),
)

#: Why a verb is not allowed from a state, where a generic "not allowed" would not help.
_WHY_NOT: dict[tuple[str, State], str] = {
    ("wake", "active"): "it is already active",
    ("sleep", "sleeping"): "it is already sleeping",
    ("sleep", "hibernated"): "it is hibernated (no engine runs to sleep): wake it first",
    ("sleep", "warm"): "it is warm (prepared, not running): wake it first",
    ("hibernate", "hibernated"): "it is already hibernated",
    ("hibernate", "sleeping"): "it is sleeping: wake it first, then hibernate it",
    ("hibernate", "warm"): "it is warm (prepared from its hibernation capsule, not running): it is hibernated already",
    ("warm", "active"): "it is active: hibernate it first",
    ("warm", "sleeping"): "it is sleeping, its engine still running: wake it",
    ("warm", "warm"): "it is already warm",
}


def move(verb: str, source: State, *, workload: str) -> Move:
    """The move *verb* makes from *source*; a RequestError naming the workload, its state and what to do otherwise."""
    for m in MOVES:
        if m.verb == verb and m.source == source:
            return m
    if source == "failed":
        why = "an earlier transition was interrupted (see `sparkrun coldsnap status`): `sparkrun run` its recipe or `sparkrun stop` it"
    else:
        why = _WHY_NOT.get((verb, source)) or "%s is allowed from %s only" % (verb, ", ".join(sorted({m.source for m in MOVES if m.verb == verb})))
    raise RequestError("cannot %s workload %s: %s" % (verb, workload, why), code="lifecycle.not_allowed")


#: what a person types for a verb that is not a ``sparkrun coldsnap`` verb of its own name
LABELS = {"activate": "sparkrun run", "release": "warm --release, or its time is up"}


def diagram() -> str:
    """The moves as a mermaid state diagram (the user guide's is checked against it)."""
    lines = ["stateDiagram-v2", "    [*] --> active: sparkrun run"]
    for m in MOVES:
        lines.append("    %s --> %s: %s" % (m.source, m.target, LABELS.get(m.verb, m.verb)))
    lines.append("    failed --> active: sparkrun run")
    lines.append("    active --> [*]: sparkrun stop")
    return "\n".join(lines)
