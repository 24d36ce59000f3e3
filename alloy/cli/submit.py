"""``alloy submit merge``: post a merge to a running Alloy and follow it with a progress bar until COMPLETED, or
print the structured error (exit status 1)."""

from __future__ import annotations

import json
import time
from typing import Any

import click

TERMINAL = {"COMPLETED", "FAILED"}


def parse_param(text: str) -> tuple[str, Any]:
    """``name=value``; the value is read as JSON when it parses (0.5, true, [0.1, 0.9]), else kept as text."""
    if "=" not in text:
        raise click.BadParameter(f"{text!r}: expected name=value")
    name, raw = text.split("=", 1)
    try:
        return name.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return name.strip(), raw


def _fail(body: Any, status: int) -> None:
    error = body.get("error", {}) if isinstance(body, dict) else {}
    click.echo(f"error {status}: {error.get('code', 'UNKNOWN')}: {error.get('message', body)}", err=True)
    if error.get("details"):
        click.echo(f"  details: {json.dumps(error['details'])}", err=True)
    raise SystemExit(1)


def follow(client, progress_url: str, *, poll_s: float = 0.5, out=None) -> dict[str, Any]:
    """Poll until a terminal state, drawing a tqdm bar of percent done; returns the last job view."""
    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    from tqdm import tqdm

    with tqdm(
        total=100.0, unit="%", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}% [{elapsed}] {postfix}", file=out
    ) as bar:
        while True:
            response = client.get(progress_url)
            job = response.json()
            if response.status_code != 200:
                _fail(job, response.status_code)
            bar.update(max(0.0, float(job.get("percent") or 0.0) - bar.n))
            bar.set_postfix_str(job["state"])
            if job["state"] in TERMINAL:
                return job
            time.sleep(poll_s)


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


@click.group()
def submit() -> None:
    """Submit jobs to a running Alloy service."""


@submit.command("merge")
@click.option("--models", "-m", cls=ManyValuesOption, multiple=True, required=True, help="Model ids: --models a b c")
@click.option("--strategy", "-s", required=True, help="slerp | ties | dare | task_arithmetic | franken_merge")
@click.option("--param", "-p", "params", multiple=True, help="Strategy parameter name=value (repeatable)")
@click.option("--output", "-o", required=True, help="ID of the merged model")
@click.option("--base", "base_model", default=None, help="Base model id (task vectors)")
@click.option("--dtype", default=None, help="float32 | float16 | bfloat16")
@click.option("--url", envvar="ALLOY_URL", default="http://127.0.0.1:8000", show_default=True)
@click.option("--key", envvar="ALLOY_API_KEY", required=True, help="API key (default: ALLOY_API_KEY)")
@click.option("--no-wait", is_flag=True, help="Print the job and return without following it")
def merge(models, strategy, params, output, base_model, dtype, url, key, no_wait) -> None:
    """Post a merge and show a progress bar until it is COMPLETED (or print the error)."""
    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    import httpx

    ids = [m for group in models for m in group.split()]
    body: dict[str, Any] = {
        "models": ids,
        "strategy": strategy,
        "parameters": dict(map(parse_param, params)),
        "output_model_id": output,
    }
    if base_model:
        body["base_model"] = base_model
    if dtype:
        body["dtype"] = dtype
    try:
        job = _submit_and_follow(
            httpx.Client(base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {key}"}, timeout=60),
            body,
            no_wait,
        )
    except httpx.HTTPError as exc:
        raise click.ClickException(f"cannot reach {url}: {exc}") from None
    if job is None:
        return
    if job["state"] == "FAILED":
        _fail({"error": job.get("error") or {}}, 200)
    click.echo(f"COMPLETED: model {job['model_id']}")


def _submit_and_follow(client, body: dict[str, Any], no_wait: bool) -> dict[str, Any] | None:
    with client:
        response = client.post("/merge/execute", json=body)
        accepted = response.json()
        if response.status_code != 202:
            _fail(accepted, response.status_code)
        click.echo(f"job {accepted['job_id']}: {accepted['progress_url']}", err=True)
        if no_wait:
            click.echo(json.dumps(accepted))
            return None
        return follow(client, accepted["progress_url"])
