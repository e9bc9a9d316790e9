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


@pytest.mark.parametrize("value", ["x", "0", "-2"])
def test_a_setting_that_is_not_a_number_is_one_line_naming_it(value):
    result = invoke("status", env={"COLDSNAP_REGISTER_THREADS": value})
    assert result.exit_code == 2
    assert "COLDSNAP_REGISTER_THREADS=%r is not a whole number of at least 1: set one, or unset it for 4" % value in one_line(result)


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


@pytest.mark.parametrize("args", [("--debug", "capabilities"), ("capabilities", "--debug")])
def test_debug_before_or_after_the_verb_shows_the_traceback(tmp_path, monkeypatch, args):
    from sparkrun_coldsnap import capabilities

    def broken():
        raise ValueError("boom in the middle")

    monkeypatch.setattr(capabilities, "collect", broken)
    with pytest.raises(ValueError, match="boom in the middle"):
        invoke(*args, env={"COLDSNAP_HOME": str(tmp_path / "home")})


def test_a_capture_over_an_existing_tag_says_it_replaces_it(tmp_path, capsys):
    from helpers import make_capsule

    from sparkrun_coldsnap.capsule.store import CapsuleStore
    from sparkrun_coldsnap.cli.capture import say_if_replacing

    store = CapsuleStore(tmp_path / "store")
    say_if_replacing(store, "synthetic:latest")
    assert capsys.readouterr().err == ""
    cap = make_capsule(store, tmp_path, pages_mb=1)
    say_if_replacing(store, "synthetic:latest")
    err = capsys.readouterr().err
    assert "synthetic:latest is capsule %s: this capture replaces it" % cap.digest[:19] in err
    say_if_replacing(store, "synthetic:other")
    assert capsys.readouterr().err == ""


# -- request documents (managers other than sparkrun) ----------------------------------------------


def restore_document(**changes) -> dict:
    from helpers import synthetic_workload

    from sparkrun_coldsnap.documents.request import CapsuleRef, RestoreRequest, ValidationSpec

    req = RestoreRequest(workload=synthetic_workload(), validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="absent"), on_missing="fail", workload_name="w")
    doc = req.model_copy(update={"request_sha256": req.digest()}).model_dump(mode="json")
    doc.update(changes)
    return doc


def run_document(tmp_path, doc, *args: str):
    import json

    from sparkrun_coldsnap.api import recapture_request
    from sparkrun_coldsnap.documents.request import RestoreRequest

    if doc == "capture":  # a capture document handed to restore
        doc = recapture_request(RestoreRequest.model_validate(dict(restore_document(), request_sha256=None))).model_dump(mode="json")
    path = tmp_path / "request.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return invoke("restore", "--request", str(path), "--store", str(tmp_path / "store"), *args)


@pytest.mark.parametrize(
    "doc, expected",
    [
        ("{not json", "not JSON (line 1 column 2"),
        (restore_document(format=9), "format 9 is not a request format this plugin reads (it reads 1)"),
        ("capture", "this verb runs restore requests"),
        (restore_document(port=1), "unknown key 'port'"),
        (restore_document(on_missing="sometimes"), "on_missing"),
        (restore_document(request_sha256="sha256:" + "0" * 64), "does not match the document's content"),
    ],
)
def test_a_bad_request_document_is_one_line_and_exit_2(tmp_path, doc, expected):
    result = run_document(tmp_path, doc)
    assert expected in one_line(result) and result.exit_code == 2


def test_a_request_for_a_capsule_that_is_not_there_exits_4_and_starts_nothing(tmp_path):
    result = run_document(tmp_path, restore_document())
    assert "capsule absent:latest is not in" in one_line(result) and result.exit_code == 4
    assert not (tmp_path / "store" / "receipts").exists()


def test_a_request_names_its_units(tmp_path):
    assert "--unit rank-9: the request's units are solo" in one_line(run_document(tmp_path, restore_document(), "--unit", "rank-9"))


def test_a_recipe_or_a_request_not_both(tmp_path):
    assert "give a RECIPE or --request FILE (exactly one)" in one_line(invoke("capture"))
