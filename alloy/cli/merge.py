"""``alloy merge RECIPE.yml OUT_DIR``: a local merge, no server. Reads Alloy or mergekit recipes; models are
local Hugging Face folders (paths relative to the working directory or to the recipe file).

Every failure prints ``Error: CODE: message`` and exits non-zero (a full disk, before or during the write:
INSUFFICIENT_STORAGE; SIGINT/SIGTERM: CANCELLED with 128 + the signal's number); nothing is left at OUT_DIR or in
a staging folder next to it."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

import click

from alloy.errors import AlloyError, ErrorCode
from alloy.ids import expand_home
from alloy.storage.disk_space import SpaceNeed, merge_output_bytes, require_free_space, storage_error


def resolve_model_path(reference: str, recipe_dir: Path) -> Path:
    for candidate in (expand_home(reference), recipe_dir / reference):
        if (candidate / "config.json").is_file():
            return candidate.resolve()
    raise AlloyError(
        ErrorCode.MODEL_NOT_FOUND,
        f"model {reference!r} is not a local model folder (alloy merge never downloads from a hub)",
        {"model_id": reference},
    )


def resolve_adapter_path(reference: str, recipe_dir: Path) -> Path:
    for candidate in (expand_home(reference), recipe_dir / reference):
        if candidate.is_dir():
            return candidate.resolve()
    raise AlloyError(ErrorCode.MODEL_NOT_FOUND, f"adapter {reference!r} is not a local folder", {"model_id": reference})


def resolve_source(reference: str, recipe_dir: Path):
    """A model folder, or for ``model+adapter`` the base folder and the LoRA adapter folder."""
    from alloy.merge.lora import LoraSource, split_reference

    model, adapter = split_reference(reference)
    base = resolve_model_path(model, recipe_dir)
    return base if adapter is None else LoraSource(base, resolve_adapter_path(adapter, recipe_dir))


def failed(code: ErrorCode | str, message: str) -> click.ClickException:
    """``Error: CODE: message`` on stderr and exit status 1, never a traceback."""
    return click.ClickException(f"{ErrorCode(code).value}: {message}")


class StopOnSignal:
    """SIGINT and SIGTERM cancel the merge between tensors (the executor removes its staging folder, nothing is
    left at OUT_DIR); a second signal interrupts at once (the staging folder is removed on the way out too)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.cancel = threading.Event()
        self.received: int | None = None
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        for signum in self.SIGNALS:
            self._saved[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *_: object) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        self.cancel.set()

    def exit(self, out_dir: Path) -> NoReturn:
        """``Error: CANCELLED: ...`` and exit status 128 + the signal's number (as the shell reports it)."""
        signum = self.received or signal.SIGINT
        name = signal.Signals(signum).name
        click.echo(f"Error: CANCELLED: merge interrupted by {name}; nothing was written to {out_dir}", err=True)
        sys.exit(128 + signum)


@click.command("merge")
@click.argument("recipe_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path), required=False)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N")
@click.option("--seed", type=int, default=None, help="Seed for DARE and stochastic TIES (overrides the recipe's)")
@click.option(
    "--shard-size",
    "shard_bytes",
    type=int,
    default=2 * 1024**3,
    show_default=True,
    help="Largest output shard in bytes",
)
@click.option("--max-in-flight", type=int, default=4, show_default=True, help="Tensors merged at once, at most")
@click.option("--workers", type=int, default=2, show_default=True, help="Merge threads")
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="torch intra-op threads of each merge thread [default: 1; for the SVD methods (tsv, iso_c, iso_cts) this "
    "process's cores / --workers]",
)
@click.option(
    "--max-memory",
    "max_in_flight_bytes",
    type=click.IntRange(min=1),
    default=512 * 1024**2,
    show_default=True,
    help="Working bytes of the tensors merged at once (the peak is about this plus the process's base)",
)
@click.option("--quiet", is_flag=True, help="No progress bar")
@click.option("--dry-run", is_flag=True, help="Print the plan and its estimated cost; read no weight, write nothing")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: the report as JSON")
def merge(
    recipe_file: Path,
    out_dir: Path | None,
    device: str,
    seed: int | None,
    shard_bytes: int,
    max_in_flight: int,
    workers: int,
    threads: int | None,
    max_in_flight_bytes: int,
    quiet: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Merge the models of RECIPE_FILE (Alloy or mergekit YAML) into the new folder OUT_DIR; with --dry-run
    (no OUT_DIR needed), print the resolved plan, the compatibility verdict and the estimated peak memory, disk
    and wall time instead.

    Free disk space is checked first (INSUFFICIENT_STORAGE); SIGINT or SIGTERM cancels and leaves nothing
    behind. Errors print as ``Error: CODE: message`` with a non-zero exit status."""
    from alloy.merge.allocator import use_huge_pages

    use_huge_pages()  # before torch's first allocation in this process (the dry run's kernel probe runs as a merge)
    if dry_run:
        from alloy.cli.merge_dry_run import print_dry_run

        limits = {"shard_bytes": shard_bytes, "max_in_flight": max_in_flight, "workers": workers}
        limits |= {"budget_bytes": max_in_flight_bytes, "threads": threads or 0}
        try:
            print_dry_run(recipe_file, seed, limits, as_json)
        except AlloyError as exc:
            raise failed(exc.code, exc.message + (f" {exc.details}" if exc.details else "")) from None
        return
    if out_dir is None:
        raise click.UsageError("OUT_DIR is required (unless --dry-run)")
    limits = {"shard_bytes": shard_bytes, "max_in_flight": max_in_flight, "workers": workers}
    limits["max_in_flight_bytes"] = max_in_flight_bytes
    limits["threads"] = threads or 0  # 0: the method's default (alloy.merge.threads)
    with StopOnSignal() as stop:
        try:
            result = _merge(recipe_file, out_dir, device, seed, limits, quiet, stop)
        except click.ClickException:
            raise
        except AlloyError as exc:
            raise failed(exc.code, exc.message + (f" {exc.details}" if exc.details else "")) from None
        except KeyboardInterrupt:
            stop.received = stop.received or signal.SIGINT
            stop.exit(out_dir)
        except Exception as exc:  # noqa: BLE001 - a command prints one line, never a traceback
            if stop.cancel.is_set():
                stop.exit(out_dir)
            full = storage_error(exc, f"{out_dir.absolute().parent}")
            if full is not None:
                raise failed(full.code, full.message) from None
            raise failed(ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}") from None
    for warning in result.warnings:
        click.echo(f"Warning: {warning}", err=True)
    click.echo(
        f"merged {result.tensors} tensors ({result.bytes / 1e6:.1f} MB) into {result.out_dir} in {result.seconds:.1f}s"
    )


def load_recipe(recipe_file: Path, seed: int | None):
    """The recipe of RECIPE_FILE (``--seed`` applied) and its models' local sources."""
    from alloy.merge.mergekit import load_recipe_yaml

    recipe = load_recipe_yaml(recipe_file.read_text())
    if seed is not None:
        recipe = recipe.model_copy(update={"seed": seed})
    named = recipe.model_ids + (recipe.tokenizer.models_named() if recipe.tokenizer else [])
    return recipe, {m: resolve_source(m, recipe_file.parent) for m in dict.fromkeys(named)}


def _merge(
    recipe_file: Path,
    out_dir: Path,
    device: str,
    seed: int | None,
    limits: dict[str, int],
    quiet: bool,
    stop: StopOnSignal,
):
    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    import torch
    from tqdm import tqdm

    from alloy.merge.executor import execute_merge
    from alloy.merge.footprint import usable_cores
    from alloy.merge.methods import get_method
    from alloy.merge.threads import intra_op_threads

    recipe, sources = load_recipe(recipe_file, seed)
    # WHY: the merge threads already run tensors in parallel; torch's default (every core per op) oversubscribes
    # the cores, and idle OpenMP threads spin (DELLA on 16 cores: 111 CPU s with 8 per merge thread, 24 with 1).
    method = get_method(recipe.variant or recipe.strategy)
    torch.set_num_threads(limits["threads"] or intra_op_threads(method, usable_cores(), limits["workers"]))
    if out_dir.exists():
        raise AlloyError(ErrorCode.ALREADY_EXISTS, f"{out_dir} already exists", {"path": str(out_dir)})
    need = SpaceNeed(out_dir.absolute().parent, merge_output_bytes(recipe, sources), "the output folder")
    require_free_space([need], name_paths=True)
    if stop.cancel.is_set():
        stop.exit(out_dir)
    bar = None if quiet else tqdm(total=0, unit="B", unit_scale=True, desc="merging", file=sys.stderr)

    def report(progress) -> None:
        if bar is None:
            return
        bar.total = progress.bytes_total
        bar.set_postfix_str(f"{progress.tensors_done}/{progress.tensors_total} tensors", refresh=False)
        bar.update(progress.bytes_done - bar.n)

    try:
        return execute_merge(
            recipe,
            sources,
            out_dir,
            device=device,
            progress=report,
            cancel=stop.cancel,
            shard_bytes=limits["shard_bytes"],
            max_in_flight=limits["max_in_flight"],
            max_in_flight_bytes=limits["max_in_flight_bytes"],
            workers=limits["workers"],
        )
    finally:
        if bar is not None:
            bar.close()


@click.command("methods")
@click.option("--family", default=None, help="Only the variants of this strategy family")
@click.option("--json", "as_json", is_flag=True, help="Print the catalogue as JSON")
def methods(family: str | None, as_json: bool) -> None:
    """Every merge method (mergekit's names) with its family, parameters, ranges and defaults."""
    import json

    from alloy.merge.methods import method_catalogue

    catalogue = [m for m in method_catalogue() if family is None or m["family"] == family]
    if as_json:
        click.echo(json.dumps(catalogue, indent=2))
        return
    for method in catalogue:
        most = "any" if method["max_models"] is None else method["max_models"]
        click.echo(
            f"{method['name']}  [{method['family']}]  models {method['min_models']}..{most}, "
            f"base {method['base']}{', random' if method['random'] else ''}"
        )
        click.echo(f"    {method['description']}")
        for p in method["parameters"]:
            bounds = (
                ""
                if p["minimum"] is None and p["maximum"] is None
                else f" in [{'' if p['minimum'] is None else p['minimum']}, {'' if p['maximum'] is None else p['maximum']}]"
            )
            default = "required" if p["required"] else f"default {p['default']}"
            click.echo(f"    - {p['name']} ({p['type']}, {p['scope']}){bounds}, {default}")
