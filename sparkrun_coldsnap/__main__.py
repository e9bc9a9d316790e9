"""``python -m sparkrun_coldsnap``: the coldsnap commands without going through sparkrun."""

from sparkrun_coldsnap.cli import main

main()
