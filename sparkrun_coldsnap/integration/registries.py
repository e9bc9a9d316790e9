"""sparkrun's recipe registries on a host that cannot reach them.

On a fresh configuration sparkrun clones its bootstrap registries; those that fail
stay listed as pending in its ``registries.yaml`` and every later command (even with
``--offline``) tries them again, printing two error lines each. Disabling a registry
does not clear that list. A private format: tested against the pinned sparkrun.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from sparkrun_coldsnap.host.atomic import write_bytes


def registries_file(config_root: Path | None = None) -> Path:
    from sparkrun.core.config import get_config_root

    return Path(config_root or get_config_root()) / "registries.yaml"


def settle_pending_bootstrap(config_root: Path | None = None) -> bool:
    """Mark sparkrun's bootstrap discovery finished; True if there was pending work to drop."""
    from sparkrun.core.registry import PENDING_BOOTSTRAP_KEY

    path = registries_file(config_root)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return False
    if not isinstance(data, dict) or not data.get(PENDING_BOOTSTRAP_KEY):
        return False
    data[PENDING_BOOTSTRAP_KEY] = []
    write_bytes(path, yaml.safe_dump(data, sort_keys=False).encode())
    return True
