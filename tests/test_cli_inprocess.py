"""The verbs' input errors, in-process through click's runner: fast, and the same one-line rule.

The real-sparkrun tier (test_cli.py) checks the same errors through sparkrun's own
entry point; this one runs in milliseconds, so every bad input can have its case.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from conftest import write_recipe
from helpers import one_error_line

from sparkrun_coldsnap.cli import coldsnap_group


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(coldsnap_group, list(args), env=env, catch_exceptions=False)


def one_line(result) -> str:
    return one_error_line(result.exit_code, result.output)


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\ncoldsnap:\n  capsule: [unclosed\n")
    line = one_line(invoke("capture", str(bad)))
    assert str(bad) in line and "malformed YAML at line 4 column 1" in line and "fix the syntax" in line


@pytest.mark.parametrize(
    "block, expected",
    [
        ("coldsnap:\n  validaton:\n    prompt: hi\n", "unknown key 'validaton'"),
        ("coldsnap:\n  on_missing: maybe\n", "on_missing"),
        ("coldsnap:\n  capsule: {name: 'Bad Name'}\n", "capsule.name"),
    ],
)
def test_a_bad_block_is_one_line_naming_the_key(tmp_path, block, expected):
    line = one_line(invoke("capture", str(write_recipe(tmp_path, coldsnap=block))))
    assert expected in line


def test_a_recipe_without_a_block_says_how_to_add_one(tmp_path):
    recipe = tmp_path / "plain.yaml"
    recipe.write_text("model: x\nruntime: vllm\n")
    assert "has no coldsnap: block: add `coldsnap: {}`" in one_line(invoke("capture", str(recipe)))


def test_missing_recipe_file(tmp_path):
    assert "does not exist: check the path" in one_line(invoke("restore", str(tmp_path / "nope.yaml")))


def test_an_override_that_is_not_key_value(tmp_path):
    recipe = write_recipe(tmp_path)
    assert "option 'tensor_parallel' is not KEY=VALUE" in one_line(invoke("capture", str(recipe), "-o", "tensor_parallel"))


def test_unknown_capsule_in_a_missing_store(tmp_path):
    assert "capsule nothing:here is not in the store" in one_line(invoke("inspect", "nothing:here", "--store", str(tmp_path / "none")))


def test_an_unexpected_error_is_one_line_naming_its_traceback_log(tmp_path, monkeypatch):
    from sparkrun_coldsnap import capabilities

    def broken():
        raise ValueError("boom in the middle")

    monkeypatch.setattr(capabilities, "collect", broken)
    result = invoke("capabilities", env={"COLDSNAP_HOME": str(tmp_path / "home")})
    line = one_line(result)
    assert line.startswith("Error: boom in the middle (traceback: ")
    log = line.split("(traceback: ", 1)[1].rstrip(")")
    assert log.startswith(str(tmp_path / "home")) and "ValueError: boom in the middle" in open(log).read()
