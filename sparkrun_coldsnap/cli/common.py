"""Options and input checks shared by the verbs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import yaml

from sparkrun_coldsnap.capsule.store import CapsuleStore, choose_store
from sparkrun_coldsnap.documents.recipe_block import parse_block
from sparkrun_coldsnap.documents.request import revision_problem
from sparkrun_coldsnap.errors import RequestError


def target_options(f):
    """-H/--hosts, --cluster, -o KEY=VALUE, --offline: where and how sparkrun places the recipe."""
    f = click.option("--offline/--online", default=None, help="Use only local images, models and registries (sparkrun's offline mode).")(f)
    f = click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE", help="Recipe override, as for `sparkrun run -o`.")(f)
    f = click.option("--cluster", default=None, help="Named sparkrun cluster to place the workload on.")(f)
    f = click.option("-H", "--hosts", default=None, help="Comma-separated hosts (default: sparkrun's default cluster).")(f)
    return f


def store_option(f):
    """--store on a verb that takes a recipe."""
    help_text = "Local capsule store (default: the recipe's coldsnap.capsule.store, else $COLDSNAP_STORE, else $COLDSNAP_HOME/store)."
    return click.option("--store", type=click.Path(path_type=Path), default=None, help=help_text)(f)


def plain_store_option(f):
    """--store on a verb without a recipe."""
    return click.option("--store", type=click.Path(path_type=Path), default=None, help="Local capsule store (default: $COLDSNAP_STORE, else $COLDSNAP_HOME/store).")(f)


def parse_overrides(options: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RequestError("option %r is not KEY=VALUE: write it as -o key=value" % item)
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            out[key] = value
    return out


def host_tuple(hosts: str | None) -> tuple[str, ...] | None:
    return tuple(h.strip() for h in hosts.split(",") if h.strip()) if hosts else None


def check_recipe_file(recipe: str, *, need_block: bool = True) -> dict[str, Any] | None:
    """Read a recipe file ourselves first, so bad YAML gets a one-line error naming the file."""
    path = Path(recipe)
    if not path.exists():
        if recipe.endswith((".yaml", ".yml")):
            raise RequestError("recipe file %s does not exist: check the path" % recipe)
        return None  # a registry recipe name: sparkrun resolves it
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = " at line %d column %d" % (mark.line + 1, mark.column + 1) if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RequestError("%s: malformed YAML%s: %s; fix the syntax" % (recipe, where, problem)) from None
    except OSError as err:
        raise RequestError("cannot read recipe %s: %s" % (recipe, err.strerror)) from None
    if not isinstance(doc, dict):
        raise RequestError("%s: a recipe must be a YAML mapping of keys, not %s" % (recipe, type(doc).__name__))
    if need_block and "coldsnap" not in doc:
        raise RequestError("%s has no coldsnap: block: add `coldsnap: {}` to capture or restore it" % recipe)
    if "coldsnap" in doc:
        parse_block(doc["coldsnap"], source=recipe)
        if not doc.get("model"):
            raise RequestError("%s: model is missing: name the model a capsule is captured from (model: ORG/NAME)" % recipe)
        problem = revision_problem(doc.get("model_revision"))
        if problem:
            raise RequestError("%s: %s" % (recipe, problem))
    return doc


def open_store(store: Path | None, recipe_doc: dict[str, Any] | None = None) -> CapsuleStore:
    configured = None
    if recipe_doc and isinstance(recipe_doc.get("coldsnap"), dict):
        configured = (recipe_doc["coldsnap"].get("capsule") or {}).get("store")
    return choose_store(store, configured)


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=False, default=str))
