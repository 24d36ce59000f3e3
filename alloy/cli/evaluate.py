"""``alloy evaluate MODEL_DIR --preset P --dataset D``: score a local model folder on a built preset's datasets,
in process (no service, no registry)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--preset", required=True, help="Built zoo preset whose datasets to use.")
@click.option("--dataset", "datasets", multiple=True, help="Dataset id (repeatable; default: all that fit the model).")
@click.option("--split", default="test", show_default=True)
@click.option("--data-dir", default=None, help="Alloy data dir (default: the configured data_dir).")
@click.option("--batch-size", default=32, show_default=True, type=int)
@click.option("--threads", default=1, show_default=True, type=int)
def evaluate(
    model_dir: str,
    preset: str,
    datasets: tuple[str, ...],
    split: str,
    data_dir: str | None,
    batch_size: int,
    threads: int,
) -> None:
    """Score MODEL_DIR on datasets of a built zoo preset and print one line per metric."""
    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    import torch

    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    from alloy.cli.zoo import _data_dir
    from alloy.errors import AlloyError
    from alloy.evaluation.dataset_sources import LocalDatasets
    from alloy.evaluation.loading import model_kind
    from alloy.evaluation.service import EvaluationService
    from alloy.zoo.presets import load_preset, quiet_build_output

    quiet_build_output()
    torch.set_num_threads(threads)
    try:
        manifest = load_preset(preset, _data_dir(data_dir))
        chosen = list(datasets) or _fitting_datasets(manifest, model_kind(Path(model_dir)))
        service = EvaluationService(
            None, None, None, None, dataset_source=LocalDatasets(manifest.datasets), batch_size=batch_size
        )
        results = service.evaluate_dir(model_dir, chosen, split)
    except AlloyError as exc:
        raise click.ClickException(exc.message) from None
    for result in results:
        click.echo(
            f"{result.dataset_id:28s} {result.split:6s} {result.metric:11s} {result.value:10.4f}  "
            f"n={result.n} ({result.duration_s:.1f}s)"
        )


def _fitting_datasets(manifest, kind: str) -> list[str]:
    encoder_task = lambda task: task.get("head") == "prototypes"  # noqa: E731
    return [d.dataset_id for d in manifest.datasets if encoder_task(d.task) == (kind == "encoder")]
