"""Evolution benchmark: the evolved recipe vs every parent vs the best grid-searched TIES and task arithmetic on
the held-out test average, candidate throughput, and the orchestration overhead of one candidate.

    nice python -m bench.evolve_bench --preset encoder-5task --population 6 --generations 4 \
        --kind pbt --kind random --seed 0 --seed 1 --seed 2 --json bench/out/evolve-encoder-5task.json
    python -m bench.evolve_bench --preset tiny          # seconds; a smoke run
    python -m bench.evolve_bench --preset tiny --kind pbt --fidelity full --fidelity asha --seed 0 --seed 1 --seed 2
    nice python -m bench.evolve_bench --preset causal-lm --search ps --search dfs --search ps+dfs \
        --seed 0 --seed 1 --json bench/out/evolve-causal-lm-dfs.json   # parameter vs data-flow space

Searches (``--search``, repeatable): ``ps`` evolves ``--config`` (parameter space, the default), ``dfs`` evolves
``--dfs-config`` (a layer path, :mod:`evolution.dataflow`), ``ps+dfs`` is Sakana's two-stage PS+DFS: the ``ps``
run of the same kind and seed (run first when not asked for) registers its winner, which becomes one more source
and the initial path of a ``dfs`` run over the same parents; its candidates and wall time are both stages'.

Protocol: the model zoo is fixed (the preset), the search is seeded: every ``--kind`` runs once per ``--seed``
with the same genome and the same candidate budget (population x generations of ``--config``), so ``random`` is
the baseline of the others; selection is on dev only and each final model is scored on test once. The table
gives the mean and the sample standard deviation over seeds of the test average and of the normalized accuracy
(per dataset: the merged model's score / the score of that dataset's own fine-tune, then averaged).

What it does, with Alloy's own code throughout:
1. starts a private Ray head (ports 20000-39999, token auth; or joins ``--address``), runs the evolution of
   ``configs/evolve-<preset>.yaml`` (budget overridable) through :class:`evolution.engine.EvolutionService` —
   the same engine as ``POST /evolutions`` and ``ray job submit`` — on a bench-only database/artifact folder
   under ``bench/out/evolve-bench/`` and the preset built under ``--data-dir`` (default ``var``);
2. the grid baselines: the best of each family chosen on dev, reported on test — read from
   ``bench/out/<preset>.json`` (written by ``bench/merge_quality.py --json``: task arithmetic and TIES) when it
   exists, else computed here with ``merge_state_dicts`` + ``CandidateEvaluator`` over a grid of task
   arithmetic, TIES and (``--grid full``) the data-free subspace operators TSV-M, Iso-C and Iso-CTS;
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
# The data-free subspace operators (Alloy-only: kernels/tsv.py, kernels/iso.py), swept over the papers' alpha the
# same way: TSV-M's paper keeps alpha 1, Iso-C/Iso-CTS pick it on validation (flat spectra want alpha > 1). Each
# range reaches past its best point on encoder-5task (a first, narrower grid had TSV-M's and Iso-C's best at its edge).
GRID_SUBSPACE = {
    "tsv": ("TSV-M", (0.7, 1.0, 1.5, 2.0, 2.5, 3.0)),
    "iso_c": ("Iso-C", (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)),
    "iso_cts": ("Iso-CTS", (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)),
}
GRID_TA_SMALL = (0.5, 1.0)  # --grid small: for models whose every score takes a minute (causal-lm on a busy CPU)
GRID_TIES_SMALL = ((0.5, 1.0),)
SEARCHES = ("ps", "dfs", "ps+dfs")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="encoder-5task")
    parser.add_argument("--config", default=None, help="default: configs/evolve-<preset>.yaml")
    parser.add_argument("--data-dir", default=os.environ.get("ALLOY_DATA_DIR", "var"), help="where the preset is built")
    parser.add_argument(
        "--kind",
        action="append",
        choices=("pbt", "cmaes", "tpe", "random", "nsga2"),
        default=None,
        help="search.kind; repeat to compare kinds (default: the config's)",
    )
    parser.add_argument(
        "--search",
        action="append",
        choices=SEARCHES,
        default=None,
        help="parameter space, data-flow space or both in two stages; repeat to compare (default: ps)",
    )
    parser.add_argument("--dfs-config", default=None, help="default: configs/evolve-<preset>-dfs.yaml")
    parser.add_argument(
        "--seed", action="append", type=int, default=None, help="search.seed; repeat for several (default: 0)"
    )
    parser.add_argument(
        "--fidelity",
        action="append",
        choices=("full", "asha"),
        default=None,
        help="full: every candidate on the whole dev split; asha: successive halving on dev subsets ending in the "
        "whole split (search.fidelity); repeat to compare (default: the config's)",
    )
    parser.add_argument("--rungs", type=int, default=None, help="search.rungs (asha)")
    parser.add_argument("--reduction-factor", type=int, default=None, help="search.reduction_factor (asha)")
    parser.add_argument("--population", type=int, default=None)
    parser.add_argument("--generations", type=int, default=None)
    parser.add_argument("--dev-batch-size", type=int, default=None)
    parser.add_argument("--time-budget-s", type=float, default=None)
    parser.add_argument("--finalists", type=int, default=None)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="logical CPUs of the private Ray head")
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    parser.add_argument(
        "--grid", choices=("full", "small"), default="full", help="small: TA λ 0.5, 1.0 and TIES keep 50%% λ 1.0"
    )
    parser.add_argument("--grid-json", default=None, help="default: bench/out/<preset>.json when it exists")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--from-json",
        default=None,
        help="report the runs of this file (a --json output or its .partial.json) instead of running them",
    )
    parser.add_argument("--bare-repeats", type=int, default=3, help="bare candidates timed (median)")
    return parser.parse_args(argv)


# ---- the evolution ---------------------------------------------------------------------------------------
def evolution_request(
    args: argparse.Namespace, kind: str | None, seed: int, search: str = "ps", fidelity: str | None = None
) -> dict[str, Any]:
    import yaml

    if search == "ps":
        path = Path(args.config or PROJECT_ROOT / "configs" / f"evolve-{args.preset}.yaml")
    else:
        path = Path(args.dfs_config or PROJECT_ROOT / "configs" / f"evolve-{args.preset}-dfs.yaml")
    request = yaml.safe_load(path.read_text())
    search_name, search = search, request.setdefault("search", {})
    if fidelity is not None:  # both score the whole dev split for whatever can be selected: no rotating batch
        search["fidelity"] = "asha" if fidelity == "asha" else "fixed"
        search["dev_batch_size"] = None
    if search.get("fidelity") == "asha":
        search.update({k: v for k, v in (("rungs", args.rungs), ("reduction_factor", args.reduction_factor)) if v})
    for key, value in (
        ("kind", kind),
        ("seed", seed),
        ("population", args.population),
        ("generations", args.generations),
        ("dev_batch_size", args.dev_batch_size),
        ("time_budget_s", args.time_budget_s),
        ("finalists", args.finalists),
    ):
        if value is not None:
            search[key] = value
    request["name"] = (
        f"evolve-bench {args.preset} {search_name} {search.get('kind', 'pbt')} {fidelity_of(search)} seed {seed}"
    )
    request.pop("output_model_id", None)  # one registered model per run
    return request


def second_stage(request: dict[str, Any], service, ps_request: dict[str, Any], ps_result: dict[str, Any]):
    """PS+DFS's second stage: the DFS request over the PS run's parents plus its registered winner (one more
    source, and the initial path), named explicitly instead of through the preset."""
    from evolution.config import parse_spec

    inputs = service.resolve_inputs(parse_spec(ps_request))
    winner = ps_result["model_id"]
    request = {**request, "name": f"{request['name']} (PS+DFS, stage 2 over {winner})"}
    request.pop("preset", None)
    request["models"] = [m for m in inputs.parents if m != inputs.base_model] + [winner]
    request["base_model"] = inputs.base_model
    request["datasets"] = list(inputs.dataset_ids)
    request["genome"] = {**request["genome"], "dataflow": {**request["genome"]["dataflow"], "init_source": winner}}
    return request


def run_one(service, request: dict[str, Any]) -> dict[str, Any]:
    job = service.jobs.create("evolution", request, owner="evolve-bench")
    print(f"evolution job {job.id}: {request['name']}: {json.dumps(request['search'])}", flush=True)
    started = time.perf_counter()
    result = service.run_job(job.id)
    record = service.jobs.get(job.id)
    if record.state.value != "COMPLETED":
        raise SystemExit(f"evolution {job.id} ended {record.state.value}: {record.error}")
    print(f"evolution done in {time.perf_counter() - started:.0f}s", flush=True)
    return {**result, "fitness_cost": fitness_cost(service, job.id)}


def runs_from_json(path: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The (request, result) pairs of an earlier bench: its ``--json`` output or the ``.partial.json`` kept as
    it ran (the grid, the bare candidate and the table are then computed as after a run)."""
    data = json.loads(path.read_text())
    if isinstance(data, list):
        return [(entry["request"], entry["result"]) for entry in data]
    return list(zip(data["requests"], data["results"]))


def fidelity_of(search: dict[str, Any]) -> str:
    if search.get("fidelity") == "asha":
        return "asha"
    return "full" if search.get("dev_batch_size", 64) is None else f"batch {search.get('dev_batch_size', 64)}"


def fitness_cost(service, job_id: str) -> dict[str, Any]:
    """What the search's fitness cost, from the recorded candidates: CPU seconds of merge + scoring inside the
    trials, dev examples scored, and how many candidates were scored on the whole dev split."""
    trials = service.trials(job_id)
    metrics = [t["metrics"] for t in trials]
    return {
        "eval_cpu_s": round(sum(float(m.get("cpu_s", 0.0)) for m in metrics), 2),
        "examples_scored": sum(int(m.get("examples_scored", m.get("batch_examples", 0))) for m in metrics),
        "full_dev_candidates": sum(1 for m in metrics if m.get("full_dev")),
        "stopped_by_rung": {
            str(rung): sum(1 for m in metrics if m.get("rung") == rung and not m.get("full_dev"))
            for rung in sorted({m["rung"] for m in metrics if "rung" in m})
        },
    }


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


def run_evolutions(args: argparse.Namespace) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], Any]:
    """Every (kind, seed) run, in order, on one Ray head."""
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
        runs = []
        ps_runs: dict[tuple[str | None, str | None, int], tuple[dict[str, Any], dict[str, Any]]] = {}
        searches = args.search or ["ps"]
        # Seed by seed, ps before ps+dfs (whose first stage it is): a failing stage shows early.
        for seed in args.seed or [0]:
            for kind, fidelity in [(k, f) for k in args.kind or [None] for f in args.fidelity or [None]]:
                for search in [s for s in ("ps", "ps+dfs", "dfs") if s in searches]:
                    stage = "ps" if search == "ps" else "dfs"
                    request = evolution_request(args, kind, seed, stage, fidelity)
                    if search == "ps+dfs":
                        if (kind, fidelity, seed) not in ps_runs:
                            ps_request = evolution_request(args, kind, seed, "ps", fidelity)
                            ps_runs[kind, fidelity, seed] = ps_request, run_one(service, ps_request)
                        ps_request, ps_result = ps_runs[kind, fidelity, seed]
                        request = second_stage(request, service, ps_request, ps_result)
                    result = run_one(service, request)
                    result["bench"] = {"search": search, "stages": [result["search"]]}
                    if search == "ps":
                        ps_runs[kind, fidelity, seed] = request, result
                    elif search == "ps+dfs":
                        result["bench"]["stages"].insert(0, ps_runs[kind, fidelity, seed][1]["search"])
                    runs.append((request, result))
                    if args.json:  # what is done survives a later failure
                        partial = Path(args.json).with_suffix(".partial.json")
                        partial.parent.mkdir(parents=True, exist_ok=True)
                        partial.write_text(json.dumps([{"request": q, "result": r} for q, r in runs], default=str))
        return runs, service
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
        self.own_finetune = own_finetunes(spec.preset, service.settings.data_dir, self.inputs.dataset_ids)

    def mean_score(self, state, split: str) -> float:
        metrics = self.evaluators[split].score(state)
        return next(value for key, value in metrics.items() if key.startswith("mean_"))


def grid_recipes(base: str, tunes: list[str], size: str = "full"):
    from alloy.merge.recipe import MergeRecipe

    models = [{"model": m} for m in tunes]
    lambdas, ties = (GRID_TA_LAMBDAS, GRID_TIES) if size == "full" else (GRID_TA_SMALL, GRID_TIES_SMALL)
    for lam in lambdas:
        yield (
            f"task arithmetic λ={lam:g}",
            "task_arithmetic",
            MergeRecipe(strategy="task_arithmetic", base_model=base, models=models, parameters={"lambda": lam}),
        )
    for density, lam in ties:
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
    if size != "full":
        return
    for method, (label, alphas) in GRID_SUBSPACE.items():
        for lam in alphas:
            yield (
                f"{label} α={lam:g}",
                method,
                MergeRecipe(
                    strategy="task_arithmetic",  # their HTTP family; the method is the variant
                    variant=method,
                    base_model=base,
                    models=models,
                    parameters={"lambda": lam},
                ),
            )


def grid_from_json(path: Path) -> dict[str, dict[str, Any]] | None:
    """Best TA and TIES rows (chosen on dev) from ``bench/merge_quality.py --json`` output."""
    if not path.exists():
        return None
    families = json.loads(path.read_text())
    if isinstance(families, dict) and "grid" in families:  # this bench's own --json output
        return families["grid"]
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
            "per_dataset": row["scores"]["test"],
            "source": str(path),
        }
    return best


def grid_computed(models: Models, size: str = "full") -> dict[str, dict[str, Any]]:
    from alloy.merge.executor import merge_state_dicts

    best: dict[str, dict[str, Any]] = {}
    sign = 1 if all(models.evaluators["dev"].metric_directions().values()) else -1  # perplexity: lower is better
    for name, family, recipe in grid_recipes(models.space.base_model, models.space.models, size):
        state = merge_state_dicts(recipe, models.tensors)
        dev = models.mean_score(state, "dev")
        print(f"  grid {name}: dev {dev:.4f}", flush=True)
        if family not in best or sign * dev > sign * best[family]["dev"]:
            best[family] = {"name": name, "dev": dev, "recipe": recipe}
    for row in best.values():
        metrics = models.evaluators["test"].score(merge_state_dicts(row.pop("recipe"), models.tensors))
        row["per_dataset"] = {d: v for d, v in metrics.items() if not d.startswith("mean_")}
        row["test"] = statistics.fmean(row["per_dataset"].values())
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


def own_finetunes(preset: str | None, data_dir: Path, dataset_ids: list[str]) -> dict[str, str]:
    """Each fitness dataset's own fine-tune (the preset's fine-tune trained on it), for normalized accuracy."""
    from alloy.zoo.presets import build_preset

    if preset is None:
        return {}
    manifest = build_preset(preset, data_dir)  # reuses the finished build
    return {m.task: m.model_id for m in manifest.models if m.role == "finetune" and m.task in dataset_ids}


def normalized(per_dataset: dict[str, float], own: dict[str, float]) -> float | None:
    """Mean over datasets of score / the dataset's own fine-tune's score (None without every reference)."""
    if not own or any(d not in own or own[d] == 0 for d in per_dataset):
        return None
    return statistics.fmean(per_dataset[d] / own[d] for d in per_dataset)


def spread(values: list[float], unit: float = 100) -> str:
    mean = statistics.fmean(values)
    deviation = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{unit * mean:.{2 if unit == 1 else 1}f} ± {unit * deviation:.{2 if unit == 1 else 1}f}"


def unit_of(metric: str) -> float:
    """Accuracies print as percentages, perplexities as they are."""
    return 1.0 if "perplexity" in metric else 100.0


# ---- report ---------------------------------------------------------------------------------------------
def run_rows(runs: list[tuple[dict[str, Any], dict[str, Any]]], own: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for request, result in runs:
        per_dataset = result["test"]["per_dataset"][result["model_id"]]
        scores = {d: v for d, v in per_dataset.items() if not d.startswith("mean_")}
        bench = result.get("bench", {"search": "ps", "stages": [result["search"]]})
        candidates = sum(stage["evaluated_this_run"] for stage in bench["stages"])  # PS+DFS: both stages
        wall_s = sum(stage["search_wall_s"] for stage in bench["stages"])
        rows.append(
            {
                "kind": f"{bench['search']} {result['search']['kind']}",
                "fidelity": fidelity_of(request["search"]),
                "seed": request["search"].get("seed", 0),
                "model_id": result["model_id"],
                "dev_fitness": result["dev_fitness"],
                "test": result["test"]["scores"][result["model_id"]],
                "normalized": normalized(scores, own),
                "candidates": candidates,
                "search_wall_s": wall_s,
                "candidates_per_minute": round(candidates / max(wall_s, 1e-9) * 60, 2),
                **result.get("fitness_cost", {}),
            }
        )
    return rows


def print_fidelity_table(rows: list[dict[str, Any]], unit: float) -> None:
    """Per run: the cost of fitness and what it bought (dev fitness: the winner re-scored on the whole split;
    ``unit``: :func:`unit_of` the metric, so perplexities print as they are, not x100)."""
    digits = 2 if unit == 1 else 1
    print(
        "\n| kind | fidelity | seed | candidates | distinct candidates/min | eval CPU-min | dev examples scored | "
        "scored on whole dev | best full-dev fitness | best full-dev fitness per eval CPU-min | test |"
        "\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for row in rows:
        cpu_min = row.get("eval_cpu_s", 0.0) / 60
        per_cpu = f"{row['dev_fitness'] / cpu_min:.2f}" if cpu_min else "-"
        print(
            f"| {row['kind']} | {row['fidelity']} | {row['seed']} | {row['candidates']} | "
            f"{row['candidates_per_minute']:.1f} | {cpu_min:.2f} | {row.get('examples_scored', '-')} | "
            f"{row.get('full_dev_candidates', '-')} | {unit * row['dev_fitness']:.{digits}f} | {per_cpu} | "
            f"{unit * row['test']:.{digits}f} |"
        )


def print_report(args, models: Models, runs, rows, grid, own, bare_s: float) -> None:
    request, result = runs[0]
    metric = result["test"]["metric"]
    search = request["search"]
    seeds = sorted({row["seed"] for row in rows})
    print(
        f"\n## evolve bench: {args.preset}, test {metric} (held-out), population {search.get('population')} x "
        f"{search.get('generations')} generations per run, seeds {seeds}\n"
    )
    unit = unit_of(metric)
    print(
        f"| model | test {metric} (mean ± sd over seeds) | normalized | candidates (mean) | search wall s (mean) "
        "| candidates/min |\n|---|---|---|---|---|---|"
    )
    for kind in dict.fromkeys(f"{row['kind']}, {row['fidelity']}" for row in rows):
        mine = [row for row in rows if f"{row['kind']}, {row['fidelity']}" == kind]
        norms = [row["normalized"] for row in mine if row["normalized"] is not None]
        rate = statistics.fmean(row["candidates_per_minute"] for row in mine)
        count = statistics.fmean(row["candidates"] for row in mine)
        wall = statistics.fmean(row["search_wall_s"] for row in mine)
        print(
            f"| evolved, {kind} ({len(mine)} seeds) | {spread([row['test'] for row in mine], unit)} | "
            f"{spread(norms) if norms else '-'} | {count:.0f} | {wall:.0f} | {rate:.1f} |"
        )
    if own:  # the reference of "normalized", and for accuracy the ceiling a merge is measured against
        print(
            f"| each dataset's own fine-tune (one model per dataset, not a merge) | "
            f"{unit * statistics.fmean(own.values()):.{2 if unit == 1 else 1}f} | 100.0 | - | - | - |"
        )
    scores = result["test"]["per_dataset"]
    for model_id in [*models.space.models, models.space.base_model]:
        per = {d: v for d, v in scores[model_id].items() if not d.startswith("mean_")}
        norm = normalized(per, own)
        label = "base" if model_id == models.space.base_model else "parent"
        line = f"| {label} {model_id} | {unit * result['test']['scores'][model_id]:.{2 if unit == 1 else 1}f} |"
        print(f"{line} {100 * norm:.1f} | - | - | - |" if norm is not None else f"{line} - | - | - | - |")
    for family, row in grid.items():
        norm = normalized(row.get("per_dataset", {}), own)
        print(
            f"| best grid {family}: {row['name']} | {unit * row['test']:.{2 if unit == 1 else 1}f} | "
            f"{f'{100 * norm:.1f}' if norm is not None else '-'} | - | - | - |"
        )
    first = rows[0]
    slots = concurrent_trials(search, args.cpus)
    per_candidate_s = first["search_wall_s"] * slots / max(first["candidates"], 1)
    print(
        f"\none candidate (first run): {per_candidate_s:.2f}s of a trial slot in the search ({slots} trials at once) "
        f"vs {bare_s:.2f}s bare in-memory merge + evaluation = orchestration overhead "
        f"x{per_candidate_s / bare_s:.2f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(1)
    bench_started = time.perf_counter()
    if args.from_json:
        runs, service = runs_from_json(Path(args.from_json)), bench_service(args)
    else:
        runs, service = run_evolutions(args)
    request, result = runs[0]
    models = Models(service, request)
    grid_path = Path(args.grid_json or PROJECT_ROOT / "bench" / "out" / f"{args.preset}.json")
    grid = grid_from_json(grid_path)
    if grid is None:
        print(f"(no grid results at {grid_path}: computing the grid here)", flush=True)
        grid = grid_computed(models, args.grid)
    bare_s = bare_candidate_seconds(models, result, request["search"].get("dev_batch_size"), args.bare_repeats)
    own = {d: result["test"]["per_dataset"][m][d] for d, m in models.own_finetune.items()}
    rows = run_rows(runs, own)
    print_report(args, models, runs, rows, grid, own, bare_s)
    print_fidelity_table(rows, unit_of(result["test"]["metric"]))
    print(f"bench total {time.perf_counter() - bench_started:.0f}s", flush=True)
    if args.json:
        out = {
            "preset": args.preset,
            "requests": [r for r, _ in runs],
            "runs": rows,
            "results": [r for _, r in runs],
            "grid": grid,
            "own_finetune_test": own,
            "bare_candidate_s": bare_s,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
