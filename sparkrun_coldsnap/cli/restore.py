"""``sparkrun coldsnap restore RECIPE``: ``sparkrun run`` that insists on the capsule; or a
restore request document run as it is (``--request``), for managers other than sparkrun."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from sparkrun_coldsnap.cli.common import check_recipe_file, emit_json, host_tuple, open_store, parse_overrides, store_option, target_options
from sparkrun_coldsnap.cli.documents import one_source, print_document, read_request, request_option
from sparkrun_coldsnap.documents.receipts import save_failure_receipt, save_receipt
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.errors import ColdsnapError, RequestError


@click.command("restore")
@click.argument("recipe", required=False)
@target_options
@store_option
@request_option
@click.option("--receipt", "receipt_file", type=click.Path(path_type=Path), default=None, help="Write the receipt here (default: beside the capsule).")
@click.option("--dry-run", is_flag=True, help="Print the restore request document this would run (JSON) on stdout and the plan on stderr; change nothing. Exits as the restore would (4: no capsule, 3: refused).")
@click.option("--unit", "unit_name", default=None, help="With --request: the launch unit of the request this process restores (it must be one of the request's).")
@click.option(
    "--wait-for-go", is_flag=True,
    help="With --request: after preparation print a `prepared` line (JSON) and wait for `activate` (or `abort`) on standard input: the barrier a manager holds while it evicts.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="With --request: print the receipt as JSON.")
def restore(recipe, hosts, cluster, options, offline, store, request_file, receipt_file, dry_run, unit_name, wait_for_go, as_json):
    """Restore RECIPE from its capsule and hand it to sparkrun (fails if there is no capsule).

    Like `sparkrun run RECIPE` for a recipe with a coldsnap: block, except that a
    missing or refused capsule is an error instead of a vanilla start. With --request
    FILE the restore request document is run as it is, without sparkrun: the workload
    is left running and its receipt says its root PID (exit codes: docs/integrators.md).
    """
    one_source(recipe, request_file)
    if request_file is not None:
        if dry_run:
            raise RequestError("--dry-run prints the document a RECIPE makes; a --request document is already one")
        req = read_request(request_file, RestoreRequest)
        assert isinstance(req, RestoreRequest)
        _run_document(req, store, receipt_file, unit_name, wait_for_go, as_json)
        return
    if unit_name or wait_for_go:
        raise RequestError("--unit and --wait-for-go go with --request FILE: sparkrun drives a recipe's units itself")
    doc = check_recipe_file(recipe)
    if dry_run:
        from sparkrun_coldsnap.integration import placement, planning, recipe_item, strategy

        actx = planning.plan_activation(recipe, hosts=host_tuple(hosts), cluster=cluster, overrides=parse_overrides(options), offline=offline)
        block = recipe_item.block_of(actx.execution.plan.recipe)
        req = placement.restore_request(actx, block).model_copy(update={"on_missing": "fail", "on_incompatible": "fail"})
        print_document(req)
        view = strategy.describe_plan(req, open_store(store, doc), block.capsule.repository)
        click.echo(view.text, err=True)
        if view.error is not None:
            raise view.error  # the exit status the restore would have
        return
    from sparkrun_coldsnap.integration import planning

    rc = planning.run_recipe(
        recipe,
        hosts=host_tuple(hosts),
        cluster=cluster,
        overrides=parse_overrides(options),
        offline=offline,
        require_capsule=True,
        receipt=str(receipt_file) if receipt_file else None,
        store=str(store) if store else None,
        dry_run=False,
    )
    if rc != 0:
        raise ColdsnapError("restore of %s ended with exit status %d" % (recipe, rc))


COMMANDS = [restore]


def _note(text: str) -> None:
    click.echo("[coldsnap] " + text, err=True)


def _event(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    sys.stdout.flush()


def _run_document(req: RestoreRequest, store: Path | None, receipt_file: Path | None, unit_name: str | None, wait_for_go: bool, as_json: bool) -> None:
    from sparkrun_coldsnap import api
    from sparkrun_coldsnap.progress import Progress

    units = [u.name for u in req.workload.topology.units]
    if unit_name is not None and unit_name not in units:
        raise RequestError("--unit %s: the request's units are %s" % (unit_name, ", ".join(units)))
    unit = unit_name or units[0]
    capsule_store = open_store(store)
    progress = Progress(quiet=as_json or wait_for_go)
    try:
        plan = api.prepare(req, store=capsule_store, progress=progress)
        if plan.refused is not None:
            save_receipt(plan.refused, None, capsule_store.receipts, req.capsule.name)
        if wait_for_go:
            ready = {"unit": unit, "state": "prepared" if plan.prepared else "vanilla", "prepare_seconds": round(plan.prepared.prepare_seconds, 4) if plan.prepared else 0.0}
            if plan.vanilla_because:
                ready["because"] = plan.vanilla_because
            _event(ready)
            go = sys.stdin.readline().strip()
            if go != "activate":
                plan.discard()
                _event({"unit": unit, "state": "discarded", "because": "told %r, not activate" % go if go else "standard input closed"})
                return
        done = api.activate(plan, progress=progress, on_note=_note)
    except ColdsnapError as err:
        failed = save_failure_receipt(err, receipt_file, capsule_store.receipts, req.capsule.name)
        if failed is not None:
            err.args = ("%s (receipt: %s)" % (err, failed),)
        raise
    for receipt in done.receipts:
        save_receipt(receipt, None, capsule_store.receipts, req.capsule.name)
    out = done.outcome
    path = save_receipt(out.receipt, receipt_file, capsule_store.receipts, req.capsule.name)
    if wait_for_go:
        _event(out.receipt.model_dump(mode="json"))
    elif as_json:
        emit_json(out.receipt.model_dump(mode="json"))
    else:
        click.echo("%s %s: root pid %d, first token %.2f s; receipt %s" % (done.how, req.capsule.ref, out.root_pid, out.ttft_seconds or 0, path))
