"""What `sparkrun coldsnap setup` shows while it installs an engine environment."""

from __future__ import annotations

import sys
from pathlib import Path

from sparkrun_coldsnap.setup.engine_install import _pip


def test_the_pip_command_the_set_up_shows_names_the_interpreter_it_runs():
    shown: list[str] = []
    _pip(Path(sys.executable), ["--version"], log=shown.append)
    assert shown == ["    $ %s -m pip --disable-pip-version-check --version" % sys.executable]
