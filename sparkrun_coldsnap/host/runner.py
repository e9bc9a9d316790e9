"""Every subprocess goes through ``run()``: argv list, no shell, timeout, logged.

Failures raise :class:`ToolError` with the command and the tail of its
output, so the CLI can print one line that says what failed.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.secrets import redact_argv

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def tail(self, lines: int = 5) -> str:
        text = (self.stderr.strip() or self.stdout.strip()).splitlines()
        return " | ".join(text[-lines:])


def run(
    argv: Sequence[str],
    *,
    timeout: float = 300.0,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    input: str | None = None,
    stdin: IO[bytes] | None = None,
    pass_fds: Sequence[int] = (),
    what: str | None = None,
) -> Completed:
    """Run *argv* and return its output; raise ToolError on failure when *check*.

    *input* is text for its standard input; *stdin* a file (or pipe) to read it from instead.
    """
    argv = tuple(str(a) for a in argv)
    shown = shlex.join(redact_argv(argv))  # what logs and errors may say of the command
    log.debug("run: %s", shown)
    try:
        cp = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            input=input,
            stdin=stdin,
            pass_fds=tuple(pass_fds),
            close_fds=True,
        )
    except FileNotFoundError as err:
        raise ToolError("%s: command not found: %s" % (what or argv[0], argv[0])) from err
    except subprocess.TimeoutExpired as err:
        raise ToolError("%s timed out after %.0f s: %s" % (what or argv[0], timeout, shown)) from err
    done = Completed(argv, cp.returncode, cp.stdout, cp.stderr)
    if check and cp.returncode != 0:
        raise ToolError("%s failed (exit %d): %s" % (what or os.path.basename(argv[0]), cp.returncode, done.tail()))
    return done
