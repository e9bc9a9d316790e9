"""Another ColdSnap plugin claiming ``coldsnap`` in sparkrun: doctor names it, where it comes
from and what to do; our registration stops with one line; sparkrun itself loads neither.

The other plugin is a FAKE of the one sparkrun's newer releases vendor, as strict as that one
where it meets sparkrun: the package ``sparkrun.plugins.coldsnap`` with a ``plugin.toml`` naming
the id ``coldsnap`` and the module, whose ``register(v)`` claims the recipe key ``coldsnap`` for
the owner ``sparkrun.plugins.coldsnap`` with an execution strategy and adds the command group
``sparkrun coldsnap``; installed by a distribution of its own (a dist-info whose RECORD lists
it), the way a separately installed copy lands in sparkrun's plugin namespace on 0.4.2.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sparkrun.plugins as sparkrun_plugins

from sparkrun_coldsnap import doctor
from sparkrun_coldsnap.integration import name_claims

FAKE_DIST = "fake-vendored-coldsnap"

FAKE_PLUGIN = '''"""FAKE of the vendored ColdSnap plugin: the same id, recipe key and command group."""
import click
from sparkrun.plugins import register_cli_command, register_recipe_item

SPARKRUN_PLUGIN_API_VERSION = 1


class FakeHandler:
    def parse(self, value, recipe):
        return value

    def validate(self, value, recipe):
        return []

    def export(self, value):
        return value


class FakeStrategy:
    name = "coldsnap"

    def preparation_steps(self, *a, **k):
        return ()

    def finalize_preparation(self, *a, **k):
        return None

    def prepare_activation(self, *a, **k):
        return None

    def activate(self, *a, **k):
        raise RuntimeError("FAKE vendored coldsnap does not launch")


@click.group(name="coldsnap")
def fake_group():
    """FAKE vendored coldsnap."""


def register(v):
    register_recipe_item("coldsnap", FakeHandler(), owner="sparkrun.plugins.coldsnap", execution_strategy=FakeStrategy())
    register_cli_command(lambda: fake_group, name="coldsnap")
'''

MANIFEST = 'schema = 1\nname = "coldsnap"\nmodule = "sparkrun.plugins.coldsnap"\nfeature = "plugins.coldsnap"\n'


def write_fake_site(site: Path) -> Path:
    """*site* holding the FAKE at ``sparkrun/plugins/coldsnap`` and the distribution that owns it."""
    pkg = site / "sparkrun" / "plugins" / "coldsnap"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_PLUGIN)
    (pkg / "plugin.toml").write_text(MANIFEST)
    info = site / ("%s-0.1.4.dist-info" % FAKE_DIST.replace("-", "_"))
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: %s\nVersion: 0.1.4\n" % FAKE_DIST)
    (info / "RECORD").write_text("sparkrun/plugins/coldsnap/__init__.py,,\nsparkrun/plugins/coldsnap/plugin.toml,,\n%s/METADATA,,\n" % info.name)
    return pkg


@pytest.fixture
def fake_vendored(tmp_path, monkeypatch):
    """The FAKE installed: its distribution on sys.path, its package in sparkrun's plugin namespace."""
    site = tmp_path / "site"
    pkg = write_fake_site(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(sparkrun_plugins, "__path__", [*sparkrun_plugins.__path__, str(pkg.parent)])
    monkeypatch.delitem(sys.modules, "sparkrun.plugins.coldsnap", raising=False)
    importlib.invalidate_caches()
    yield pkg
    sys.modules.pop("sparkrun.plugins.coldsnap", None)


def test_doctor_says_no_other_plugin_claims_the_name_where_none_does():
    check = doctor._name_claims()
    assert check.status == "ok" and "no other plugin claims 'coldsnap'" in check.detail


def test_doctor_names_the_other_coldsnap_plugin_where_it_comes_from_and_what_to_do(fake_vendored):
    check = doctor._name_claims()
    assert check.status == "fail"
    assert "%s 0.1.4, installed as sparkrun.plugins.coldsnap (%s)" % (FAKE_DIST, fake_vendored) in check.detail
    assert "sparkrun loads neither" in check.detail
    assert check.fix == "pip uninstall %s (or, to use it instead of this plugin: pip uninstall sparkrun-coldsnap)" % FAKE_DIST


def test_a_second_distributions_entry_point_named_coldsnap_is_named_too(tmp_path, monkeypatch):
    info = tmp_path / "site" / "other_coldsnap-2.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: other-coldsnap\nVersion: 2.0\n")
    (info / "entry_points.txt").write_text("[sparkrun.plugins]\ncoldsnap = other_coldsnap.plugin\n")
    monkeypatch.syspath_prepend(str(info.parent))
    (claimant,) = name_claims.other_claimants()
    assert claimant.what == "other-coldsnap's entry point coldsnap = other_coldsnap.plugin" and claimant.remove.startswith("pip uninstall other-coldsnap")


def test_our_registration_after_the_other_stops_with_one_line_and_registers_nothing(fake_vendored):
    from sparkrun.core.cli_registry import registered_cli_commands
    from sparkrun.core.recipe_items import get_recipe_item
    from sparkrun.core.registration import PluginConflictError, clear_plugin_conflicts, registry_transaction

    from sparkrun_coldsnap.integration import plugin

    class Rollback(Exception):
        pass

    try:
        with registry_transaction():
            importlib.import_module("sparkrun.plugins.coldsnap").register(None)
            with pytest.raises(PluginConflictError) as err:
                plugin.register(None)
            assert get_recipe_item("coldsnap").owner == "sparkrun.plugins.coldsnap"
            assert [c.name for c in registered_cli_commands() if c.name == "coldsnap"] == ["coldsnap"]
            raise Rollback
    except Rollback:
        pass
    finally:
        clear_plugin_conflicts()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("another ColdSnap plugin already registered the recipe key coldsnap: (owner sparkrun.plugins.coldsnap)")
    assert "sparkrun-coldsnap is not loaded" in message and "sparkrun-coldsnap doctor" in message


def test_sparkrun_loads_neither_and_doctor_says_why(tmp_path, sparkrun):
    """The FAKE lands where sparkrun 0.4.2 looks for it: a copy of sparkrun's package (links to its
    files) whose plugin folder also holds the FAKE, first on PYTHONPATH."""
    site = tmp_path / "site"
    write_fake_site(site)
    real = Path(sparkrun_plugins.__file__).parent
    for entry in real.parent.iterdir():
        if entry.name != "plugins":
            (site / "sparkrun" / entry.name).symlink_to(entry)
    for entry in real.iterdir():
        (site / "sparkrun" / "plugins" / entry.name).symlink_to(entry)
    env = {**sparkrun.env, "PYTHONPATH": str(site), "SPARKRUN_FEATURE_PLUGINS_COLDSNAP": "1"}

    group = subprocess.run([str(Path(sys.executable).parent / "sparkrun"), "coldsnap", "--help"], env=env, capture_output=True, text=True, timeout=300)
    assert group.returncode != 0 and "No such command 'coldsnap'" in group.stderr
    assert "Plugin identity 'coldsnap' is claimed by ('in-tree', 'sparkrun.plugins.coldsnap', None) and ('installed', 'coldsnap', 'sparkrun-coldsnap')" in group.stderr

    out = subprocess.run([str(Path(sys.executable).parent / "sparkrun-coldsnap"), "doctor"], env=env, capture_output=True, text=True, timeout=300, cwd=os.fspath(tmp_path))
    line = next(l for l in out.stdout.splitlines() if "coldsnap name" in l)
    assert line.startswith("[FAIL]") and "%s 0.1.4, installed as sparkrun.plugins.coldsnap" % FAKE_DIST in line
