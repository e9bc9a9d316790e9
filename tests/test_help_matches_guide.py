"""The user guide's option reference and the verbs' help are the same text.

Every option of every verb has its row, with its help text, under the verb's heading
in docs/user-guide.md ("Every verb's options"), and every row there is a real option.
Regenerate the section with: python tests/test_help_matches_guide.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from sparkrun_coldsnap.cli import coldsnap_group

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "user-guide.md"
START, END = "<!-- options: generated from the verbs' help; checked by tests/test_help_matches_guide.py -->", "<!-- end of options -->"


def option_rows() -> dict[str, list[str]]:
    """Each verb's heading, with one table row per option (names, then the help text)."""
    out: dict[str, list[str]] = {}
    for name in sorted(coldsnap_group.commands):
        cmd = coldsnap_group.commands[name]
        args = " ".join(p.human_readable_name for p in cmd.params if isinstance(p, click.Argument))
        rows = []
        for p in cmd.params:
            if isinstance(p, click.Option):
                names = "/".join(sorted(p.opts + p.secondary_opts, key=len))
                rows.append("| `%s` | %s |" % (names, (p.help or "").replace("|", "\\|")))
        out["### `%s%s`" % (name, (" " + args) if args else "")] = rows
    return out


def render() -> str:
    parts = [START]
    for heading, rows in option_rows().items():
        parts += ["", heading, "", "| option | meaning |", "| --- | --- |", *rows]
    return "\n".join(parts + ["", END])


def guide_section() -> str:
    text = GUIDE.read_text()
    return text[text.index(START) : text.index(END) + len(END)]


def test_every_option_has_help():
    missing = [(h, r) for h, rows in option_rows().items() for r in rows if r.endswith("|  |")]
    assert missing == []


def test_every_option_of_every_verb_is_in_the_guide_with_its_help():
    section = guide_section()
    headings = re.split(r"\n(?=### `)", section)
    found = {part.splitlines()[0]: set(part.splitlines()[1:]) for part in headings if part.startswith("### `")}
    for heading, rows in option_rows().items():
        assert heading in found, "the guide has no %s section: regenerate it" % heading
        for row in rows:
            assert row in found[heading], "%s: %s is not in the guide as the help says it" % (heading, row)


def test_the_guide_lists_no_option_that_does_not_exist():
    assert guide_section() == render(), "regenerate the guide's option reference: python tests/test_help_matches_guide.py"


if __name__ == "__main__":
    text = GUIDE.read_text()
    if START in text:
        text = text[: text.index(START)] + render() + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n## Every verb's options\n\n" + render() + "\n"
    GUIDE.write_text(text)
    sys.exit(0)
