"""The line of an engine's log that says why it failed.

An engine that fails prints its first error, then pages of what followed from it: a
worker's ``CUDA error: unspecified launch failure`` is followed by the executor's "Worker
proc died unexpectedly", the engine core's "EngineCore encountered a fatal error" and the
API server's 500. The end of the log names the last of these; the first error-bearing line
names the cause. Both are kept, the first ahead.
"""

from __future__ import annotations

import re

#: the prefixes vLLM and SGLang put ahead of a message: the process, the level, the time, the source
_PREFIX = re.compile(r"^(?:\((?:[\w.-]+) pid=\d+\)\s*)?(?:\[[^\]]*\]\s*)?(?:(?:ERROR|WARNING|CRITICAL|INFO)\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s*)?")
#: a line that states an error: an exception with its message, CUDA's and NCCL's own words
_ERROR = re.compile(r"(?:\b[A-Za-z_][\w.]*(?:Error|Exception)\b\s*:\s*\S|^Error\b\s*:|\bCUDA error\b|\bNCCL WARN\b|\bout of memory\b|\bKilled\b|\bSegmentation fault\b)", re.IGNORECASE)
#: lines that say an error happened elsewhere, or how to debug one: never the cause
_ECHO = re.compile(
    r"EngineCore encountered|died unexpectedly|Search for `cuda|CUDA kernel errors might be|For debugging consider|Compile with `TORCH_USE_CUDA_DSA|"
    r"^Traceback|Error getting async|shutting down|See stack trace|Dumping (?:input|scheduler)|Worker failed with error|Exception raised from|frame #\d+",
    re.IGNORECASE,
)
LIMIT = 300


def clean(line: str) -> str:
    return _PREFIX.sub("", line.strip()).strip()


def causes(text: str) -> list[str]:
    """The first error-bearing line of *text* and, where another follows, the last: at most two,
    each without its log prefix and cut to :data:`LIMIT` characters."""
    found = [c for c in (clean(line) for line in text.splitlines()) if c and _ERROR.search(c) and not _ECHO.search(c)]
    if not found:
        return []
    picked = [found[0]] if found[0] == found[-1] else [found[0], found[-1]]
    return [c[:LIMIT] for c in picked]


def summary(text: str, *, tail_lines: int = 5) -> str:
    """What a log says of a failure, in one line: its causes (``first error: ...; last error:
    ...``) where it states any, else its last *tail_lines* non-empty lines."""
    found = causes(text)
    if found:
        return "first error: %s" % found[0] + ("; last error: %s" % found[1] if len(found) > 1 else "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-tail_lines:])[-600:] or "empty"
