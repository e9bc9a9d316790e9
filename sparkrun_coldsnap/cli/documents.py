"""Request documents on the command line: ``--dry-run`` prints one, ``--request FILE`` runs one."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sparkrun_coldsnap.documents.request import CaptureRequest, RestoreRequest
from sparkrun_coldsnap.errors import RequestError


def request_option(f):
    return click.option(
        "--request", "request_file", default=None, metavar="FILE",
        help="Run this request document (JSON, as --dry-run prints it; - for standard input) instead of a recipe: no sparkrun placement.",
    )(f)  # fmt: skip


def read_request(request_file: str, kind: type[CaptureRequest] | type[RestoreRequest]) -> CaptureRequest | RestoreRequest:
    """The document at *request_file* (or standard input), strictly parsed, of the verb's kind."""
    from sparkrun_coldsnap import api

    source = "standard input" if request_file == "-" else request_file
    try:
        text = sys.stdin.read() if request_file == "-" else Path(request_file).read_text()
    except OSError as err:
        raise RequestError("cannot read request %s: %s" % (source, err.strerror)) from None
    req = api.load_request(text, source=source)
    if not isinstance(req, kind):
        raise RequestError("%s: operation %r: this verb runs %s requests" % (source, req.operation, kind.model_fields["operation"].default))
    return req


def one_source(recipe: str | None, request_file: str | None) -> None:
    if (recipe is None) == (request_file is None):
        raise RequestError("give a RECIPE or --request FILE (exactly one)")


def print_document(req: CaptureRequest | RestoreRequest) -> None:
    """The request exactly as a run would use it, stamped with its digest."""
    click.echo(req.model_copy(update={"request_sha256": req.digest()}).model_dump_json(indent=2))
