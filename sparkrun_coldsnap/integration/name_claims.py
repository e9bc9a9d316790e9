"""Who else claims the name ``coldsnap`` in sparkrun, where it comes from, and what to do.

sparkrun keys a plugin by its id, and ``coldsnap`` is also the id of the ColdSnap plugin that
sparkrun's newer releases vendor (module ``sparkrun.plugins.coldsnap``, feature
``plugins.coldsnap``, recipe key ``coldsnap:``, command group ``sparkrun coldsnap``). sparkrun
0.4.2 already knows that id: it loads a package found at ``sparkrun.plugins.coldsnap`` (a
separately installed copy, or a vendored one) under the same feature, and one managed by
``sparkrun plugins add`` under the id its manifest names. Whenever two sources claim the id,
sparkrun loads neither (one warning line), ``sparkrun coldsnap`` is no command and every launch
stops on the conflict; the choice (one enabling flag for both) cannot separate them. Only
removing one does. This module finds the others without importing them (for doctor), and
:func:`check_unclaimed` stops our registration with one line where another got there first.

Reads sparkrun internals (the recipe-item and CLI registries, the managed-plugin store).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkrun_coldsnap.integration.recipe_item import KEY

#: the module of the ColdSnap plugin sparkrun vendors (and the place a separate install of it takes)
VENDORED_MODULE = "sparkrun.plugins.%s" % KEY
OUR_DISTRIBUTION = "sparkrun-coldsnap"
OUR_MODULE = "sparkrun_coldsnap.integration.plugin"
PINNED_SPARKRUN = "0.4.2"


@dataclass(frozen=True)
class Claimant:
    """Another plugin that claims ``coldsnap``: what it is, where it comes from, how to remove it."""

    what: str
    where: str
    remove: str

    def line(self) -> str:
        return "%s (%s)" % (self.what, self.where)


def _owner_of(path: Path) -> importlib.metadata.Distribution | None:
    """The installed distribution whose files include *path*."""
    path = path.resolve()
    for dist in importlib.metadata.distributions():
        for f in dist.files or ():
            if f.name == path.name and Path(str(dist.locate_file(f))).resolve() == path:
                return dist
    return None


def _in_namespace() -> list[Claimant]:
    try:
        spec = importlib.util.find_spec(VENDORED_MODULE)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.origin:
        return []
    origin = Path(spec.origin)
    dist = _owner_of(origin)
    folder = origin.parent
    if dist is None:
        return [Claimant("the package %s" % VENDORED_MODULE, "%s, no installed distribution owns it" % folder, "delete %s" % folder)]
    name = dist.metadata["Name"] or "?"
    if name.lower() == "sparkrun":
        return [Claimant("the ColdSnap plugin sparkrun %s vendors as %s" % (dist.version, VENDORED_MODULE), str(folder),
                         "to keep this plugin, install the sparkrun it is built for: pip install sparkrun==%s; "
                         "to use the vendored one: pip uninstall %s" % (PINNED_SPARKRUN, OUR_DISTRIBUTION))]  # fmt: skip
    return [Claimant("%s %s, installed as %s" % (name, dist.version, VENDORED_MODULE), str(folder),
                     "pip uninstall %s (or, to use it instead of this plugin: pip uninstall %s)" % (name, OUR_DISTRIBUTION))]  # fmt: skip


def _entry_points() -> list[Claimant]:
    out = []
    for ep in importlib.metadata.entry_points(group="sparkrun.plugins", name=KEY):
        dist = ep.dist.name if ep.dist else None
        if ep.value.split(":")[0] == OUR_MODULE and dist in (OUR_DISTRIBUTION, None):
            continue
        out.append(Claimant("%s's entry point %s = %s" % (dist or "an unnamed distribution", KEY, ep.value), "group sparkrun.plugins",
                            "pip uninstall %s (or, to use it instead of this plugin: pip uninstall %s)" % (dist or "it", OUR_DISTRIBUTION)))  # fmt: skip
    return out


def _managed() -> list[Claimant]:
    try:
        from sparkrun.core.config import SparkrunConfig
        from sparkrun.core.plugin_identity import normalize_plugin_id
        from sparkrun.core.plugin_store import PluginStore

        _, records = PluginStore(SparkrunConfig()).snapshot()
    except Exception:  # noqa: BLE001 - no store, or one sparkrun cannot read: nothing managed claims it
        return []
    out = []
    for name in records:
        try:
            if normalize_plugin_id(name) == KEY:
                out.append(Claimant("the plugin %r managed by sparkrun" % name, "`sparkrun plugins list`", "sparkrun plugins remove %s" % name))
        except ValueError:
            continue
    return out


def other_claimants() -> list[Claimant]:
    """Every other plugin that claims ``coldsnap`` in this sparkrun, found without importing any."""
    return [*_in_namespace(), *_entry_points(), *_managed()]


def _describe(value: Any) -> str:
    owner = getattr(value, "owner", None)
    owner = getattr(owner, "plugin_id", owner)
    if isinstance(owner, str) and owner:
        return owner
    target = getattr(value, "command", value)
    return str(getattr(target, "__module__", None) or type(target).__module__)


def check_unclaimed() -> None:
    """Stop our registration with one line when another plugin already holds the recipe key
    or the command group (sparkrun records the conflict, so launches stop too)."""
    from sparkrun.core.cli_registry import registered_cli_commands
    from sparkrun.core.recipe_items import get_recipe_item
    from sparkrun.core.registration import raise_plugin_conflict

    item = get_recipe_item(KEY)
    held = None
    if item is not None and not _ours(item.handler):
        held = "the recipe key %s: (owner %s)" % (KEY, _describe(item))
    else:
        cmd = next((c for c in registered_cli_commands() if c.parent == () and c.name == KEY and not _ours(c.command)), None)
        if cmd is not None:
            held = "the command group `sparkrun %s` (from %s)" % (KEY, _describe(cmd))
    if held:
        raise_plugin_conflict("another ColdSnap plugin already registered %s: %s is not loaded; keep one of them (`sparkrun-coldsnap doctor` names the other and how to remove it)" % (held, OUR_DISTRIBUTION))


def _ours(value: Any) -> bool:
    """A loader function or handler object of this plugin."""
    value = getattr(value, "callback", None) or value  # a click command: the function behind it
    module = getattr(value, "__module__", None) if callable(value) and not hasattr(value, "parse") else type(value).__module__
    return str(module or "").startswith("sparkrun_coldsnap.")
