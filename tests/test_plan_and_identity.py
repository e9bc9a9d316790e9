"""What a dry run says the run would do, and what a capsule's identity is made of."""

from __future__ import annotations

from helpers import synthetic_workload

from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.compat.admission import at_port, identity_differences
from sparkrun_coldsnap.documents.request import CapsuleRef, RestoreRequest, ValidationSpec
from sparkrun_coldsnap.errors import NotFoundError
from sparkrun_coldsnap.integration.strategy import describe_plan


def request(**changes) -> RestoreRequest:
    fields = dict(workload=synthetic_workload(), validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="absent"), workload_name="w")
    fields.update(changes)
    return RestoreRequest(**fields)


def test_a_missing_capsule_with_a_repository_is_planned_as_a_pull(tmp_path):
    view = describe_plan(request(), CapsuleStore(tmp_path / "store"), "registry.example:5000/team/capsules")
    assert "the run would pull capsule absent:latest from registry.example:5000/team/capsules" in view.text
    assert "start vanilla" not in view.text and view.error is None


def test_a_missing_capsule_without_a_repository_reads_as_a_sentence(tmp_path):
    view = describe_plan(request(), CapsuleStore(tmp_path / "store"))
    assert view.text.startswith("dry run: the run would start the engine vanilla: there is no capsule absent:latest in ")
    assert view.error is None


def test_a_missing_capsule_that_must_exist_plans_the_failure_and_its_exit_status(tmp_path):
    view = describe_plan(request(on_missing="fail"), CapsuleStore(tmp_path / "store"))
    assert "the run would fail: there is no capsule absent:latest" in view.text
    assert isinstance(view.error, NotFoundError) and view.error.exit_code == 4


def test_the_recipe_file_name_is_not_part_of_the_identity():
    captured = synthetic_workload("tiny-vllm-cpu")
    assert identity_differences(captured, synthetic_workload("tiny-pull")) == []


def test_the_port_is_place_only_where_the_driver_forwards_it():
    captured = synthetic_workload()
    captured = captured.model_copy(update={"launch": captured.launch.model_copy(update={"command": "serve --port 8000 --x 1"})})
    other = at_port(captured, 8001)
    assert other.launch.command == "serve --port 8001 --x 1" and other.launch.port == 8001
    assert identity_differences(captured, other, port_forwarded=True) == []
    assert identity_differences(captured, other) == [
        "launch.command: captured 'serve --port 8000 --x 1', recipe now 'serve --port 8001 --x 1'",
        "launch.port: captured 8000, recipe now 8001",
    ]
