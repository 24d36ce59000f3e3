"""Evolution benchmark: the evolved recipe vs every parent vs the best grid-searched TIES and task arithmetic on
the held-out test average, candidate throughput, and the orchestration overhead of one candidate.

    nice python bench/evolve_bench.py --preset encoder-5task --population 6 --generations 4 \
        --json bench/out/evolve-encoder-5task.json
    python bench/evolve_bench.py --preset tiny          # seconds; a smoke run

What it does, with Alloy's own code throughout:
1. starts a private Ray head (ports 20000-39999, token auth; or joins ``--address``), runs the evolution of
   ``configs/evolve-<preset>.yaml`` (budget overridable) through :class:`evolution.engine.EvolutionService` —
   the same engine as ``POST /evolutions`` and ``ray job submit`` — on a bench-only database/artifact folder
   under ``bench/out/evolve-bench/`` and the preset built under ``--data-dir`` (default ``var``);
2. the grid baselines: the best task arithmetic and the best TIES chosen on dev, reported on test — read from
   ``bench/out/<preset>.json`` (written by ``bench/merge_quality.py --json``) when it exists, else computed
   here with ``merge_state_dicts`` + ``CandidateEvaluator`` over a small grid;
3. the overhead: seconds of one trial slot per candidate in the search (search wall time x trials running at
   once / candidates; Tune scheduling, PBT pauses, actors, checkpoints and records included) vs a bare
   in-process ``merge_state_dicts`` + ``CandidateEvaluator.score`` of the same recipe on the same dev examples,
   one thread, as each trial runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))

# The grid a careful user would sweep by hand (TIES needs lambda > 1 once most of each task vector is trimmed).
GRID_TA_LAMBDAS = (0.3, 0.5, 0.6, 0.7, 0.8, 1.0, 1.2)
GRID_TIES = tuple((density, lam) for density in (0.2, 0.5) for lam in (0.7, 1.0, 1.5, 2.0))  # (density, lambda)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="encoder-5task")
    parser.add_argument("--config", default=None, help="default: configs/evolve-<preset>.yaml")
    parser.add_argument("--data-dir", default=os.environ.get("ALLOY_DATA_DIR", "var"), help="where the preset is built")
    parser.add_argument("--kind", choices=("pbt", "cmaes"), default=None, help="override search.kind")
    parser.add_argument("--population", type=int, default=None)
    parser.add_argument("--generations", type=int, default=None)
    parser.add_argument("--dev-batch-size", type=int, default=None)
    parser.add_argument("--time-budget-s", type=float, default=None)
    parser.add_argument("--finalists", type=int, default=None)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="logical CPUs of the private Ray head")
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    parser.add_argument("--grid-json", default=None, help="default: bench/out/<preset>.json when it exists")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


# ---- the evolution ---------------------------------------------------------------------------------------
def evolution_request(args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    path = Path(args.config or PROJECT_ROOT / "configs" / f"evolve-{args.preset}.yaml")
    request = yaml.safe_load(path.read_text())
    search = request.setdefault("search", {})
    for key, value in (
        ("kind", args.kind),
        ("population", args.population),
        ("generations", args.generations),
        ("dev_batch_size", args.dev_batch_size),
        ("time_budget_s", args.time_budget_s),
        ("finalists", args.finalists),
    ):
        if value is not None:
            search[key] = value
    request["name"] = f"evolve-bench {args.preset}"
    return request


def bench_service(args: argparse.Namespace):
    from alloy.config import load_settings
    from evolution.engine import EvolutionService

    root = PROJECT_ROOT / "bench" / "out" / "evolve-bench"
    root.mkdir(parents=True, exist_ok=True)
    settings = load_settings(
        data_dir=Path(args.data_dir).resolve(),
        database={"url": f"sqlite:///{root / 'alloy.db'}"},
        artifacts={"uri": str(root / "artifacts")},
    )
    service = EvolutionService.from_settings(settings)
    service.db.upgrade()
    return service


def run_evolution(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], Any]:
    import ray

    from alloy.control.ray_head import start_ray_head, stop_ray_head

    head = None
    if args.address is None:
        head = start_ray_head(tempfile.mkdtemp(prefix="aeb", dir="/tmp"), num_cpus=args.cpus)
        head.apply_env()
        address = head.address
    else:
        address = args.address
    try:
        ray.init(address=address, log_to_driver=False)
        service = bench_service(args)
        request = evolution_request(args)
        job = service.jobs.create("evolution", request, owner="evolve-bench")
        print(f"evolution job {job.id}: {json.dumps(request['search'])}", flush=True)
        started = time.perf_counter()
        result = service.run_job(job.id)
        record = service.jobs.get(job.id)
        if record.state.value != "COMPLETED":
            raise SystemExit(f"evolution {job.id} ended {record.state.value}: {record.error}")
        print(f"evolution done in {time.perf_counter() - started:.0f}s", flush=True)
        return request, result, service
    finally:
        ray.shutdown()
        if head is not None:
            stop_ray_head(head)


# ---- baselines and overhead -------------------------------------------------------------------------------
class Models:
    """The preset's parents as fp32 tensors and the dev/test evaluators, loaded once."""

    def __init__(self, service, request: dict[str, Any]):
        from alloy.evaluation.candidate import CandidateEvaluator
        from evolution.config import parse_spec
        from evolution.parents import as_tensors, load_parents
        from evolution.scoring import InMemoryDatasets

        spec = parse_spec(request)
        self.inputs = service.resolve_inputs(spec)
        self.space = service.genome_space(spec, self.inputs)
        self.tensors = as_tensors(load_parents(self.inputs.parents))
        data = InMemoryDatasets.read(self.inputs.source, self.inputs.dataset_ids, ["dev", "test"])
        skeleton = str(self.inputs.parents[self.inputs.base_model])
        self.evaluators = {
            split: CandidateEvaluator(skeleton, data, self.inputs.dataset_ids, split) for split in ("dev", "test")
        }

    def mean_score(self, state, split: str) -> float:
        metrics = self.evaluators[split].score(state)
        return next(value for key, value in metrics.items() if key.startswith("mean_"))


def grid_recipes(base: str, tunes: list[str]):
    from alloy.merge.recipe import MergeRecipe

    models = [{"model": m} for m in tunes]
    for lam in GRID_TA_LAMBDAS:
        yield (
            f"task arithmetic λ={lam:g}",
            "task_arithmetic",
            MergeRecipe(strategy="task_arithmetic", base_model=base, models=models, parameters={"lambda": lam}),
        )
    for density, lam in GRID_TIES:
        yield (
            f"TIES keep {density:.0%} λ={lam:g}",
            "ties",
            MergeRecipe(
                strategy="ties",
                base_model=base,
                models=[{**m, "parameters": {"density": density}} for m in models],
                parameters={"lambda": lam},
            ),
        )


def grid_from_json(path: Path) -> dict[str, dict[str, Any]] | None:
    """Best TA and TIES rows (chosen on dev) from ``bench/merge_quality.py --json`` output."""
    if not path.exists():
        return None
    families = json.loads(path.read_text())
    rows = [row for family in families for row in family.get("rows", [])]
    best: dict[str, dict[str, Any]] = {}
    for family in ("task_arithmetic", "ties"):
        candidates = [r for r in rows if r["family"] == family and {"dev", "test"} <= set(r["scores"])]
        if not candidates:
            return None
        row = max(candidates, key=lambda r: statistics.fmean(r["scores"]["dev"].values()))
        best[family] = {
            "name": row["name"],
            "dev": statistics.fmean(row["scores"]["dev"].values()),
            "test": statistics.fmean(row["scores"]["test"].values()),
            "source": str(path),
        }
    return best


def grid_computed(models: Models) -> dict[str, dict[str, Any]]:
    from alloy.merge.executor import merge_state_dicts

    best: dict[str, dict[str, Any]] = {}
    for name, family, recipe in grid_recipes(models.space.base_model, models.space.models):
        state = merge_state_dicts(recipe, models.tensors)
        dev = models.mean_score(state, "dev")
        print(f"  grid {name}: dev {dev:.4f}", flush=True)
        if family not in best or dev > best[family]["dev"]:
            best[family] = {"name": name, "dev": dev, "recipe": recipe}
    for row in best.values():
        row["test"] = models.mean_score(merge_state_dicts(row.pop("recipe"), models.tensors), "test")
        row["source"] = "computed by bench/evolve_bench.py"
    return best


def bare_candidate_seconds(models: Models, result: dict[str, Any], batch_size: int | None, repeats: int = 3) -> float:
    """One candidate without Tune: merge the winner's genome in memory, score it on one dev batch."""
    from alloy.merge.executor import merge_state_dicts
    from evolution.trainable import rotating_batches

    recipe = models.space.decode(result["genome"])
    evaluator = models.evaluators["dev"]
    sizes = {dataset.dataset_id: len(dataset) for dataset in evaluator.datasets}
    timings = []
    for generation in range(1, repeats + 1):
        started = time.perf_counter()
        state = merge_state_dicts(recipe, models.tensors)
        evaluator.score(state, rotating_batches(generation, sizes, batch_size, 0))
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def concurrent_trials(search: dict[str, Any], cpus: int) -> int:
    """How many trials the search ran at once: as many as fit the CPUs, at most a population (PBT) or one
    generation (CMA-ES), at most ``max_concurrent_trials``."""
    fit = int(cpus // search.get("cpus_per_trial", 0.5))
    limit = search.get("max_concurrent_trials") or search.get("population", 8)
    return max(1, min(fit, search.get("population", 8), limit))


# ---- report ---------------------------------------------------------------------------------------------
def table(
    result: dict[str, Any], grid: dict[str, dict[str, Any]], parents: list[str], base: str
) -> list[tuple[str, float]]:
    scores = result["test"]["scores"]
    rows = [(f"evolved ({result['search']['kind']}, {result['model_id']})", scores[result["model_id"]])]
    rows += [(f"parent {m}", scores[m]) for m in parents]
    rows.append((f"base {base}", scores[base]))
    rows += [(f"best grid {family}: {row['name']}", row["test"]) for family, row in grid.items()]
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(1)
    bench_started = time.perf_counter()
    request, result, service = run_evolution(args)

    models = Models(service, request)
    grid_path = Path(args.grid_json or PROJECT_ROOT / "bench" / "out" / f"{args.preset}.json")
    grid = grid_from_json(grid_path)
    if grid is None:
        print(f"(no grid results at {grid_path}: computing the grid here)", flush=True)
        grid = grid_computed(models)
    bare_s = bare_candidate_seconds(models, result, request["search"].get("dev_batch_size"))

    search = result["search"]
    evaluated = search["evaluated_this_run"]
    slots = concurrent_trials(request["search"], args.cpus)
    per_candidate_s = search["search_wall_s"] * slots / max(evaluated, 1)
    rows = table(result, grid, models.space.models, models.space.base_model)
    metric = result["test"]["metric"]
    print(
        f"\n## evolve bench: {args.preset}, test {metric} (held-out), {search['kind']} "
        f"population {search['population']} x {search['generations']} generations\n"
    )
    print(f"| model | test {metric} |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {100 * value:.1f} |")
    evolved = rows[0][1]
    best_parent = max(result["test"]["scores"][m] for m in models.space.models)
    best_grid = max(row["test"] for row in grid.values())
    print(
        f"\nevolved - best parent: {100 * (evolved - best_parent):+.1f} points; "
        f"evolved - best grid merge: {100 * (evolved - best_grid):+.1f} points"
    )
    print(
        f"candidates: {evaluated} in {search['search_wall_s']:.0f}s of search = "
        f"{search['candidates_per_minute']:.2f} candidates/minute"
    )
    print(
        f"one candidate: {per_candidate_s:.2f}s of a trial slot in the search ({slots} trials at once) vs "
        f"{bare_s:.2f}s bare in-memory merge + evaluation = orchestration overhead x{per_candidate_s / bare_s:.2f}"
    )
    print(
        f"finalize (finalists on full dev, merge to disk, register, test scores): {result['finalize_s']:.0f}s; "
        f"bench total {time.perf_counter() - bench_started:.0f}s",
        flush=True,
    )

    if args.json:
        out = {
            "preset": args.preset,
            "request": request,
            "result": result,
            "grid": grid,
            "table": [{"model": n, "test": v} for n, v in rows],
            "candidates_per_minute": search["candidates_per_minute"],
            "seconds_per_candidate": per_candidate_s,
            "concurrent_trials": slots,
            "bare_candidate_s": bare_s,
            "overhead_ratio": per_candidate_s / bare_s,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
