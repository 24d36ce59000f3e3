"""``alloy submit merge``: post a merge to a running Alloy (through :mod:`alloy.client`) and follow its live
events on one progress line until COMPLETED, or print the structured error (exit status 1).

The URL and key come from ``--url`` / ``--key``, else ``ALLOY_URL`` / ``ALLOY_API_KEY``, else the client's
defaults (``http://127.0.0.1:8470``, no key)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click

from alloy.client import AlloyAPIError, Client

STRATEGIES = "slerp | ties | dare | task_arithmetic | franken_merge"
_SLICE = re.compile(r"(?P<model>[^:]+):(?P<start>\d+)-(?P<end>\d+)")


def parse_param(text: str) -> tuple[str, Any]:
    """``name=value``; the value is read as JSON when it parses (0.5, true, [0.1, 0.9]), else kept as text."""
    if "=" not in text:
        raise click.BadParameter(f"{text!r}: expected name=value", param_hint="--param")
    name, raw = text.split("=", 1)
    try:
        return name.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return name.strip(), raw


def parse_params(texts: tuple[str, ...]) -> dict[str, Any]:
    """Every ``--param``; a name given twice is refused (a gradient is one JSON list: ``t=[0,0.5,1]``)."""
    params: dict[str, Any] = {}
    for text in texts:
        name, value = parse_param(text)
        if name in params:
            raise click.BadParameter(
                f"{name!r} given twice; give a gradient as one JSON list, e.g. {name}=[0,1]", param_hint="--param"
            )
        params[name] = value
    return params


def parse_slice(text: str) -> dict[str, Any]:
    """``MODEL:START-END`` -> ``{"model": MODEL, "layer_range": [START, END]}`` (layers START..END-1)."""
    match = _SLICE.fullmatch(text.strip())
    if match is None:
        raise click.BadParameter(f"{text!r}: expected MODEL:START-END, e.g. tune1:0-4", param_hint="--slice")
    return {"model": match["model"], "layer_range": [int(match["start"]), int(match["end"])]}


def recipe_body(path: Path) -> dict[str, Any]:
    """The request fields of a recipe file (Alloy or mergekit YAML), validated the way the server parses it."""
    from alloy.errors import AlloyError
    from alloy.merge.mergekit import load_recipe_yaml

    try:
        recipe = load_recipe_yaml(path.read_text())
    except AlloyError as exc:
        raise AlloyAPIError(exc.code.value, None, exc.message, exc.details) from None
    body: dict[str, Any] = {
        "models": [ref.model for ref in recipe.models],
        "strategy": recipe.strategy,
        "variant": recipe.variant,
        "parameters": recipe.parameters,
        "base_model": recipe.base_model,
        "dtype": recipe.dtype or recipe.compute_dtype,
        "seed": recipe.seed,
        "model_parameters": {ref.model: ref.parameters for ref in recipe.models if ref.parameters} or None,
        "slices": [piece.model_dump(mode="json") for piece in recipe.slices] if recipe.slices else None,
    }
    return {k: v for k, v in body.items() if v is not None}


class ManyValuesOption(click.Option):
    """An option that takes every following word up to the next option: ``--models a b c``."""

    def add_to_parser(self, parser, ctx):
        result = super().add_to_parser(parser, ctx)
        for name in self.opts:
            option = parser._long_opt.get(name) or parser._short_opt.get(name)
            if option is None:
                continue
            original = option.process

            def process(value, state, original=original):
                words = [value]
                while state.rargs and not state.rargs[0].startswith("-"):
                    words.append(state.rargs.pop(0))
                original(" ".join(words), state)

            option.process = process
        return result


def connection_options(command):
    """``--url`` and ``--key``: shared by every command that talks to a running service."""
    command = click.option(
        "--key", envvar="ALLOY_API_KEY", show_envvar=True, default=None, help="API key [default: $ALLOY_API_KEY]"
    )(command)
    return click.option(
        "--url",
        envvar="ALLOY_URL",
        show_envvar=True,
        default=None,
        help="Service URL [default: $ALLOY_URL, else http://127.0.0.1:8470]",
    )(command)


def print_error(error: AlloyAPIError) -> None:
    status = f" {error.status}" if error.status else ""
    click.echo(f"error{status}: {error.code}: {error.message}", err=True)
    if error.details:
        click.echo(f"  details: {json.dumps(error.details)}", err=True)


@click.group()
def submit() -> None:
    """Submit jobs to a running Alloy service."""


@submit.command("merge")
@click.option("--models", "-m", cls=ManyValuesOption, multiple=True, help="Model ids: --models a b c")
@click.option("--strategy", "-s", default=None, help=STRATEGIES)
@click.option("--variant", default=None, help="A merge method of the strategy's family (mergekit name; GET /methods)")
@click.option(
    "--param",
    "-p",
    "params",
    multiple=True,
    help="Strategy parameter name=value (repeatable; each name once, a gradient as a JSON list)",
)
@click.option(
    "--slice",
    "slices",
    multiple=True,
    metavar="MODEL:START-END",
    help="franken_merge: layers START..END-1 of MODEL, stacked in the order given (repeatable)",
)
@click.option(
    "--recipe",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A recipe file (Alloy or mergekit YAML) instead of --models/--strategy/--param/--slice",
)
@click.option("--output", "-o", required=True, help="ID of the merged model")
@click.option("--base", "base_model", default=None, help="Base model id (task vectors)")
@click.option("--dtype", default=None, help="float32 | float16 | bfloat16")
@click.option("--seed", type=int, default=None, help="Seed for stochastic strategies (dare)")
@click.option(
    "--evaluate",
    "evaluate",
    multiple=True,
    metavar="DATASET",
    help="Evaluate the merged model on this registered dataset before COMPLETED (repeatable)",
)
@click.option("--split", default="test", show_default=True, help="Dataset split for --evaluate")
@connection_options
@click.option("--no-wait", is_flag=True, help="Print the job id and return without following it")
def merge(
    models,
    strategy,
    variant,
    params,
    slices,
    recipe,
    output,
    base_model,
    dtype,
    seed,
    evaluate,
    split,
    url,
    key,
    no_wait,
) -> None:
    """Post a merge and show a progress bar until it is COMPLETED (or print the error)."""
    body = _merge_body(models, strategy, params, slices, recipe, base_model, dtype, seed)
    if variant:
        body["variant"] = variant
    body["output_model_id"] = output
    if evaluate:
        body["evaluate"] = {"datasets": list(evaluate), "split": split}
    try:
        with Client(url, key) as client:
            job = client.submit_merge(_validated(body))
            click.echo(f"job {job.id}", err=True)
            if no_wait:
                click.echo(json.dumps({"job_id": job.id}))
                return
            view = job.wait(progress=True)
    except AlloyAPIError as error:
        print_error(error)
        raise SystemExit(1) from None
    if view.state.value == "FAILED":
        failure = view.error
        print_error(
            AlloyAPIError(failure.code if failure else "INTERNAL_ERROR", None, failure.message if failure else "")
        )
        raise SystemExit(1)
    click.echo(f"COMPLETED: model {view.model_id}")
    for row in _evaluation_rows(view.result):
        click.echo(
            f"  {row['dataset_id']} ({row['split']}): {row['metric']} {row['value']:.6g} over {row['n']} examples"
        )


def _evaluation_rows(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The scores of ``--evaluate`` in a COMPLETED merge's result (none without it)."""
    evaluation = (result or {}).get("evaluation") or {}
    return list(evaluation.get("results") or [])


def _merge_body(models, strategy, params, slices, recipe, base_model, dtype, seed) -> dict[str, Any]:
    if recipe is not None:
        if models or strategy or params or slices:
            raise click.UsageError("--recipe replaces --models, --strategy, --param and --slice; give one or the other")
        try:
            body = recipe_body(recipe)
        except AlloyAPIError as error:
            print_error(error)
            raise SystemExit(1) from None
    else:
        if not strategy:
            raise click.UsageError(f"give --strategy ({STRATEGIES}) or --recipe FILE")
        body = {
            "models": [m for group in models for m in group.split()],
            "strategy": strategy,
            "parameters": parse_params(params),
        }
        if slices:
            body["slices"] = [parse_slice(text) for text in slices]
            if not body["models"]:  # a franken merge's models are its slices' models
                body["models"] = list(dict.fromkeys(piece["model"] for piece in body["slices"]))
    for name, value in (("base_model", base_model), ("dtype", dtype), ("seed", seed)):
        if value is not None:
            body[name] = value
    return body


def _validated(body: dict[str, Any]) -> dict[str, Any]:
    """Checked against the server's MergeRequest model before sending (the same VALIDATION_FAILED)."""
    from alloy.client._common import merge_body

    fields = dict(body)
    return merge_body(fields.pop("models"), fields.pop("strategy"), fields.pop("output_model_id"), **fields)
