"""``alloy merge --dry-run RECIPE``: the plan, the compatibility verdict and the estimated cost of a local merge,
from the models' headers (no weight is read, nothing is written)."""

from __future__ import annotations

import time
from pathlib import Path

import click


def print_dry_run(recipe_file: Path, seed: int | None, limits: dict[str, int], as_json: bool) -> None:
    from alloy.cli.merge import load_recipe
    from alloy.merge import executor  # noqa: F401 - imported as the merge imports it, so its start is counted
    from alloy.merge.dry_run import dry_run
    from alloy.merge.lora import model_folder
    from alloy.model_manifest import read_manifest

    recipe, sources = load_recipe(recipe_file, seed)
    manifests = {m: read_manifest(model_folder(sources[m])) for m in recipe.model_ids}
    # WHY: a merge process starts as this one did (interpreter, imports, recipe, manifests); its CPU so far is that
    # start measured on this machine, where a constant was off by 60% on one VM
    report = dry_run(recipe, manifests, **limits, startup_s=time.process_time())
    if as_json:
        click.echo(report.model_dump_json(indent=2))
        return
    verdict = report.compatibility
    click.echo(f"method {report.method}: {', '.join(report.models)} (base {report.base_model})")
    if not verdict.compatible:
        click.echo(f"NOT compatible: {verdict.code}: {verdict.message}")
        raise SystemExit(1)
    click.echo("compatible")
    click.echo(
        f"{report.tensors} tensors ({report.computed_tensors} merged, {report.tensors - report.computed_tensors} "
        f"copied), {report.output_layers} output layers, dtype {report.output_dtype or 'as the inputs'}"
    )
    for p in report.parameters:
        values = ", ".join(f"{v:g}" for v in p.values) if p.values is not None else f"{p.min:g} .. {p.max:g}"
        click.echo(f"  {p.name} ({p.scope}): {values}")
    click.echo(f"{len(report.shards)} shards:")
    for shard in report.shards:
        click.echo(f"  {shard.file}: {shard.tensors} tensors, {shard.bytes / 1e6:.1f} MB")
    e = report.estimates
    if e is not None:
        click.echo(
            f"estimates: peak memory {e.peak_memory_bytes / 1e9:.2f} GB (budget {e.memory_budget_bytes / 1e9:.2f} GB, "
            f"largest tensor {e.largest_tensor_bytes / 1e9:.2f} GB), disk {e.disk_bytes / 1e9:.2f} GB, "
            f"wall {e.wall_seconds:.1f}s, CPU {e.cpu_seconds:.1f}s"
        )
