"""Bad input to the verbs: one line naming the input and the fix, and the documented exit code
(2 invalid input, 4 not found), never a sparkrun wrapper sentence or a Python None."""

from __future__ import annotations

import pytest
from conftest import write_recipe
from helpers import one_error_line

PIN = "model_revision: 973ff5dd93da77ddc2a1bffa8e29d4d207f245dd"
BAD_RECIPES = {
    "no model_revision": ({PIN: ""}, "model_revision is missing"),
    "a branch as model_revision": ({PIN: "model_revision: main"}, "model_revision 'main' is not immutable"),
    "no model": ({"model: coldsnap/tiny-qwen2\n": ""}, "model is missing"),
    "a defaults that is not a mapping": ({"defaults:\n": "defaults: 5\nold_defaults:\n"}, "'defaults' field must be a mapping"),
    "an unknown block key": ({"engine_env: vllm-cpu": "engine_env: vllm-cpu\n  bogus: 1"}, "unknown key 'bogus'"),
    "a bad block value": ({"max_tokens: 16": "max_tokens: lots"}, "validation.max_tokens"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECIPES))
def test_a_bad_recipe_is_one_line_with_exit_2(sparkrun, tmp_path, case):
    replace, expected = BAD_RECIPES[case]
    recipe = write_recipe(tmp_path, replace=replace)
    cp = sparkrun.coldsnap("capture", str(recipe), "-H", "localhost", "--dry-run", check=False)
    line = one_error_line(cp.returncode, cp.stderr)
    assert cp.returncode == 2, cp.stderr
    assert expected in line and str(recipe.name) in line
    for wrapper in ("Recipe is invalid", "could not parse top-level recipe item", "None", "traceback"):
        assert wrapper not in line, line


@pytest.mark.parametrize("verb", [("list",), ("inspect", "tiny"), ("verify", "tiny"), ("delete", "tiny"), ("gc",)])
def test_a_store_that_is_a_regular_file_is_named_as_such(sparkrun, tmp_path, verb):
    store = tmp_path / "store"
    store.write_text("not a store\n")
    cp = sparkrun.coldsnap(*verb, "--store", str(store), check=False)
    line = one_error_line(cp.returncode, cp.stderr)
    assert cp.returncode == 2 and "capsule store %s is not a directory" % store in line, cp.stderr
    assert "no capsules" not in cp.stdout and "not in the store" not in line


def test_a_missing_capsule_exits_4(sparkrun, tmp_path):
    cp = sparkrun.coldsnap("inspect", "nothing:here", "--store", str(tmp_path / "store"), check=False)
    assert cp.returncode == 4 and "capsule nothing:here is not in the store" in one_error_line(cp.returncode, cp.stderr)
