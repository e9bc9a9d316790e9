"""sparkrun's own planning and launching, driven from the plugin's verbs."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from sparkrun_coldsnap.errors import ColdsnapError, RequestError, coldsnap_cause
from sparkrun_coldsnap.integration.placement import OPT_PLAN_INTO, OPT_RECEIPT, OPT_REQUIRE_CAPSULE, OPT_STORE


@contextlib.contextmanager
def recipe_errors(recipe: str) -> Iterator[None]:
    """sparkrun's handling of a recipe, with its recipe errors turned into ours (exit 2, one line).

    sparkrun wraps what the recipe item raised ("Recipe is invalid: Plugin coldsnap could not
    parse ..."): the plugin's own error is handed on as it was; sparkrun's own recipe errors
    become a RequestError naming the recipe.
    """
    from sparkrun.core.recipe import RecipeError

    try:
        yield
    except ColdsnapError:
        raise
    except Exception as err:
        ours = coldsnap_cause(err)
        if ours is not None:
            raise ours from None
        cur: BaseException | None = err
        while cur is not None:
            if isinstance(cur, RecipeError):
                raise RequestError("%s: %s; fix the recipe" % (recipe, str(cur).strip() or type(cur).__name__)) from err
            cur = cur.__cause__
        raise


def plan_activation(recipe: str, *, hosts: tuple[str, ...] | None, cluster: str | None, overrides: Mapping[str, Any], offline: bool | None) -> Any:
    """sparkrun's placement and rendering for *recipe*, without launching anything.

    A real (probed) plan, then a dry run of the launcher whose strategy call
    hands back the ActivationContext: the serve command, port, hosts and
    cluster id exactly as ``sparkrun run`` would use them.
    """
    from sparkrun import api

    holder: list = []
    opts = api.RunOptions(recipe, hosts=hosts, cluster=cluster, overrides=dict(overrides), offline=offline, strategy_options={OPT_PLAN_INTO: holder})
    with recipe_errors(recipe), unreachable_named(cluster, hosts):
        plan = api.plan(opts)
        if plan.runtime is None:
            raise RequestError("%s: sparkrun could not resolve a runtime for this recipe" % recipe)
        api.run(dataclasses.replace(opts, dry_run=True), plan=plan)
    if not holder:
        raise RequestError("%s has no coldsnap: block, or the coldsnap plugin is not enabled (sparkrun plugins enable coldsnap)" % recipe)
    return holder[0]


@contextlib.contextmanager
def unreachable_named(cluster: str | None, hosts: tuple[str, ...] | None) -> Iterator[None]:
    """A placement sparkrun could not complete, with the host that does not answer named.

    sparkrun places only the hosts its probe reached and says how many ranks it placed, not
    which host was missing: each of the cluster's hosts is asked through sparkrun's session."""
    try:
        yield
    except ColdsnapError:
        raise
    except Exception as err:
        if "placed" not in str(err):
            raise
        missing = _unreachable(cluster, hosts)
        if not missing:
            raise
        raise RequestError(
            "%s: %s; sparkrun could place only the hosts that answer (%s)" % ("; ".join(missing), "bring it back or run on a cluster without it", str(err).strip().splitlines()[0]),
            code="host.unreachable",
        ) from err


def _unreachable(cluster: str | None, hosts: tuple[str, ...] | None) -> list[str]:
    from sparkrun_coldsnap.integration.transport import open_cluster

    try:
        with open_cluster(cluster, hosts) as session:
            out = []
            for rank, host in enumerate(session.hosts):
                try:
                    session.run(host, ["true"], timeout=30)
                except ColdsnapError as err:
                    out.append("host %s (rank %d of %s) cannot be reached: %s" % (host, rank, cluster or "the hosts given", err.message))
            return out
    except ColdsnapError:
        return []


def run_recipe(
    recipe: str, *, hosts: tuple[str, ...] | None, cluster: str | None, overrides: Mapping[str, Any], offline: bool | None,
    require_capsule: bool, receipt: str | None, store: str | None, dry_run: bool,
) -> int:  # fmt: skip
    """``sparkrun run`` of *recipe* through the API (eviction and metadata included)."""
    from sparkrun import api

    opts = api.RunOptions(
        recipe, hosts=hosts, cluster=cluster, overrides=dict(overrides), offline=offline, dry_run=dry_run,
        strategy_options={OPT_REQUIRE_CAPSULE: require_capsule, OPT_RECEIPT: receipt, OPT_STORE: store},
    )  # fmt: skip
    with recipe_errors(recipe):
        result = api.run(opts)
    return int(result.rc)
