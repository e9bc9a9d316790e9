"""Setting sparkrun's unreachable bootstrap registries to rest (against the pinned sparkrun)."""

from __future__ import annotations

import yaml

from sparkrun_coldsnap.integration.registries import settle_pending_bootstrap


def test_settled_bootstrap_is_no_longer_pending_for_sparkrun(tmp_path):
    from sparkrun.core.registry import PENDING_BOOTSTRAP_KEY, RegistryManager, application_profile_bootstrap_urls

    urls = list(application_profile_bootstrap_urls())
    assert urls, "the pinned sparkrun has bootstrap registries"
    doc = {"config_version": 1, "registries": [], PENDING_BOOTSTRAP_KEY: urls}
    (tmp_path / "registries.yaml").write_text(yaml.safe_dump(doc))
    manager = RegistryManager(config_root=tmp_path, cache_root=tmp_path / "cache")
    assert manager._pending_bootstrap_urls() == urls  # what makes every command clone again
    assert settle_pending_bootstrap(tmp_path) is True
    assert RegistryManager(config_root=tmp_path, cache_root=tmp_path / "cache")._pending_bootstrap_urls() == []
    assert yaml.safe_load((tmp_path / "registries.yaml").read_text())["config_version"] == 1
    assert settle_pending_bootstrap(tmp_path) is False  # nothing left to settle


def test_no_registries_file_is_left_alone(tmp_path):
    assert settle_pending_bootstrap(tmp_path) is False
    assert not (tmp_path / "registries.yaml").exists()
