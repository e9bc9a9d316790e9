"""The ``coldsnap:`` recipe item: parsed strictly, so a bad block stops the launch with one line."""

from __future__ import annotations

from typing import Any

from sparkrun_coldsnap import extensions
from sparkrun_coldsnap.documents.recipe_block import ColdsnapBlock, parse_block
from sparkrun_coldsnap.documents.request import revision_problem
from sparkrun_coldsnap.errors import RequestError

KEY = "coldsnap"
OWNER = "coldsnap"


def source_of(recipe: Any) -> str:
    return str(getattr(recipe, "source_path", None) or getattr(recipe, "name", None) or "recipe")


class RecipeItem:
    """Parses the ``coldsnap:`` block strictly; an error blocks the launch."""

    def parse(self, value: Any, recipe: Any) -> ColdsnapBlock:
        block = parse_block(value, source=source_of(recipe))
        check_block(block, recipe)
        return block

    def validate(self, value: ColdsnapBlock, recipe: Any) -> list[str]:
        return []

    def export(self, value: ColdsnapBlock, recipe: Any) -> Any:
        return value.model_dump(mode="json", exclude_defaults=True)


def check_block(block: ColdsnapBlock, recipe: Any) -> None:
    """Cross-field checks: names must resolve, the model revision must be immutable."""
    src = source_of(recipe)
    reg = extensions.registry()
    if block.driver != "auto":
        try:
            reg.driver(block.driver)
        except RequestError as err:
            raise RequestError("%s: coldsnap.driver: %s" % (src, err)) from None
    try:
        if block.engine:
            reg.engine(block.engine)
        else:
            reg.engine_for_runtime(str(getattr(recipe, "runtime", "") or ""))
    except RequestError as err:
        raise RequestError("%s: coldsnap.engine: %s" % (src, err)) from None
    problem = revision_problem(getattr(recipe, "model_revision", None))
    if problem:
        raise RequestError("%s: %s" % (src, problem))


def block_of(recipe: Any) -> ColdsnapBlock:
    block = recipe.plugin_item(KEY, None)
    if block is None:
        raise RequestError("%s has no coldsnap: block: add one to capture or restore it" % source_of(recipe))
    return block
