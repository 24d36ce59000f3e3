"""The merge-quality table of the merging papers, on a built zoo preset, with Alloy's own merge code.

For each base model of the preset and its fine-tunes: the base, every fine-tune on every task, the uniform
average, task arithmetic over a lambda grid, TIES over density x lambda, DARE — per task and averaged, on each
requested split — then retention (merged / fine-tuned score on the merged tasks) as the number of merged tasks
grows, with hyper-parameters chosen on the first split (dev).

    python -m bench.merge_quality --preset encoder-5task --split dev,test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from alloy.evaluation.candidate import CandidateEvaluator
from alloy.evaluation.dataset_sources import LocalDatasets
from alloy.evaluation.tasks import higher_is_better
from alloy.merge.executor import merge_state_dicts
from alloy.merge.recipe import MergeRecipe
from alloy.zoo.manifest import ModelEntry, PresetManifest
from alloy.zoo.presets import build_preset
from bench.quality_rows import Row, Scorer, best, fmt, load_state_dict, mean, merge_rows, print_table


def run_family(manifest: PresetManifest, base: ModelEntry, args) -> dict:
    tunes = [m for m in manifest.finetunes(base.model_id) if m.task]
    datasets = [t.task for t in tunes]
    higher = all(
        higher_is_better("perplexity" if manifest.dataset(d).task.get("type") == "perplexity" else "accuracy")
        for d in datasets
    )
    percent = higher
    short = {d: d.split("-", 1)[1] if "-" in d else d for d in datasets}
    print(f"\n## {manifest.preset}: base {base.model_id}, {len(tunes)} fine-tunes, splits {args.split}\n", flush=True)

    started = time.perf_counter()
    states = {base.model_id: load_state_dict(base)}
    states.update({t.model_id: load_state_dict(t) for t in tunes})
    scorer = Scorer(manifest, base, datasets, args.splits, args.batch_size)
    print(
        f"(loaded {len(states)} models and prepared {len(datasets)} datasets in {time.perf_counter() - started:.1f}s)",
        flush=True,
    )

    rows = [Row(f"base ({base.model_id})", "base", model_id=base.model_id)]
    rows += [Row(f"fine-tune {short[t.task]}", "fine-tune", model_id=t.model_id) for t in tunes]
    rows += merge_rows(
        base.model_id,
        [t.model_id for t in tunes],
        args.lambdas,
        args.densities,
        args.ties_lambdas,
        args.dare_drop,
        args.dare_lambdas,
    )
    merge_seconds = 0.0
    for row in rows:
        if row.recipe is None:
            state = states[row.model_id]
        else:
            t0 = time.perf_counter()
            state = merge_state_dicts(row.recipe, states)
            merge_seconds += time.perf_counter() - t0
        row.scores = scorer.score(state)
        print(
            f"  scored {row.name}: "
            + ", ".join(f"{s} {fmt(mean(v.values()), percent)}" for s, v in row.scores.items()),
            flush=True,
        )

    eval_split, select_split = args.splits[-1], args.splits[0]
    own = {t.task: next(r for r in rows if r.model_id == t.model_id).scores for t in tunes}
    fine_row = Row(
        "each fine-tune on its own task",
        "summary",
        scores={s: {d: own[d][s][d] for d in datasets} for s in args.splits},
    )
    print()
    print_table(
        rows[:1] + rows[1 : 1 + len(tunes)] + [fine_row] + rows[1 + len(tunes) :], datasets, args.splits, percent, short
    )

    chosen = {f: best(rows, f, select_split, higher) for f in ("average", "task_arithmetic", "ties", "dare")}
    print(
        f"\nChosen on {select_split} (reported on {eval_split}): "
        + "; ".join(f"{r.name} = {fmt(mean(r.scores[eval_split].values()), percent)}" for r in chosen.values())
    )

    # Retention as the number of merged tasks grows (prefixes of the task list), chosen hyper-parameters.
    retention: dict[str, dict[int, float]] = {}
    if higher and len(tunes) >= 3:
        print(f"\nRetention on {eval_split} (merged ÷ fine-tuned accuracy, mean over the merged tasks):\n")
        counts = list(range(2, len(tunes) + 1))
        print("| method | " + " | ".join(f"{k} tasks" for k in counts) + " |")
        print("|---|" + "---|" * len(counts))
        for _family, row in chosen.items():
            retention[row.name] = {}
            for k in counts:
                subset = tunes[:k]
                ids = [t.model_id for t in subset]
                recipe = row.recipe.model_copy(update={"models": [m for m in row.recipe.models if m.model in ids]})
                scores = scorer.score(
                    merge_state_dicts(recipe, states), only=[t.task for t in subset], splits=[eval_split]
                )[eval_split]
                retention[row.name][k] = mean(scores[t.task] / own[t.task][eval_split][t.task] for t in subset)
            print(
                f"| {row.name} | " + " | ".join(f"{100 * retention[row.name][k]:.1f}%" for k in counts) + " |",
                flush=True,
            )

    timing = {
        "setup_s": round(scorer.setup_seconds, 1),
        "merge_s": round(merge_seconds, 1),
        "eval_s": {s: round(v, 1) for s, v in scorer.seconds.items()},
        "models_scored": len(rows),
        "examples": {s: sum(len(d) for d in e.datasets) for s, e in scorer.evaluators.items()},
    }
    print(f"\nTimes: {json.dumps(timing)}", flush=True)
    return {
        "base": base.model_id,
        "rows": [{"name": r.name, "family": r.family, "scores": r.scores} for r in rows],
        "chosen": {f: r.name for f, r in chosen.items()},
        "retention": retention,
        "timing": timing,
    }


def perplexity_rows(base: ModelEntry, tunes: list[ModelEntry], num_layers: int) -> list[Row]:
    """Merges that make sense for one causal LM and its (possibly zero) domain fine-tunes."""
    ids = [t.model_id for t in tunes]
    rows = []
    if len(ids) >= 2:
        rows.append(
            Row(
                "uniform average",
                "average",
                MergeRecipe(strategy="task_arithmetic", variant="linear", models=[{"model": m} for m in ids]),
            )
        )
        for lam in (0.5, 1.0):
            rows.append(
                Row(
                    f"task arithmetic λ={lam:g}",
                    "task_arithmetic",
                    MergeRecipe(
                        strategy="task_arithmetic",
                        base_model=base.model_id,
                        models=[{"model": m} for m in ids],
                        parameters={"lambda": lam},
                    ),
                )
            )
        rows.append(
            Row(
                "TIES keep 50% λ=1",
                "ties",
                MergeRecipe(
                    strategy="ties",
                    base_model=base.model_id,
                    models=[{"model": m, "parameters": {"density": 0.5}} for m in ids],
                    parameters={"lambda": 1.0},
                ),
            )
        )
        rows.append(
            Row(
                f"slerp t=0.5 ({ids[0]}, {ids[1]})",
                "slerp",
                MergeRecipe(
                    strategy="slerp",
                    base_model=ids[0],
                    models=[{"model": ids[0]}, {"model": ids[1]}],
                    parameters={"t": 0.5},
                ),
            )
        )
    for model_id in ids:
        rows.append(
            Row(
                f"slerp t=0.5 (base, {model_id})",
                "slerp",
                MergeRecipe(
                    strategy="slerp",
                    base_model=base.model_id,
                    models=[{"model": base.model_id}, {"model": model_id}],
                    parameters={"t": 0.5},
                ),
            )
        )
    two_thirds, third = (2 * num_layers) // 3, num_layers // 3
    rows.append(
        Row(
            f"franken base[0:{two_thirds}] + base[{third}:{num_layers}]",
            "franken",
            MergeRecipe(
                strategy="franken_merge",
                slices=[
                    {"model": base.model_id, "layer_range": [0, two_thirds]},
                    {"model": base.model_id, "layer_range": [third, num_layers]},
                ],
            ),
        )
    )
    return rows


def run_perplexity_family(manifest: PresetManifest, base: ModelEntry, args) -> dict:
    """Perplexity (lower is better) of the base, its fine-tunes, merges of them, and a franken self-stack."""
    import tempfile

    from alloy.merge.executor import execute_merge

    tunes = manifest.finetunes(base.model_id)
    datasets = [d.dataset_id for d in manifest.datasets if d.task.get("type") == "perplexity"]
    short = {d: d.rsplit("-", 1)[-1] for d in datasets}
    print(
        f"\n## {manifest.preset}: base {base.model_id}, {len(tunes)} fine-tunes, perplexity on {args.split}\n",
        flush=True,
    )
    started = time.perf_counter()
    states = {base.model_id: load_state_dict(base)}
    states.update({t.model_id: load_state_dict(t) for t in tunes})
    scorer = Scorer(manifest, base, datasets, args.splits, args.batch_size)
    num_layers = scorer.evaluators[args.splits[0]].loaded.model.config.num_hidden_layers
    print(
        f"(loaded {len(states)} models, prepared {len(datasets)} datasets in {time.perf_counter() - started:.1f}s)",
        flush=True,
    )
    rows = [Row(f"base ({base.model_id})", "base", model_id=base.model_id)]
    rows += [Row(f"fine-tune {t.model_id}", "fine-tune", model_id=t.model_id) for t in tunes]
    rows += perplexity_rows(base, tunes, num_layers)
    merge_seconds = 0.0
    sources = {base.model_id: base.path, **{t.model_id: t.path for t in tunes}}
    for row in rows:
        t0 = time.perf_counter()
        if row.recipe is None:
            row.scores = scorer.score(states[row.model_id])
        elif row.family == "franken":  # a different layer count: merge to a folder, score with its own skeleton
            with tempfile.TemporaryDirectory(prefix="alloy-franken-") as scratch:
                execute_merge(row.recipe, sources, Path(scratch) / "out")
                merge_seconds += time.perf_counter() - t0
                source = LocalDatasets(manifest.datasets)
                row.scores = {}
                for split in args.splits:
                    e0 = time.perf_counter()
                    row.scores[split] = {
                        k: v
                        for k, v in CandidateEvaluator(
                            Path(scratch) / "out", source, datasets, split, batch_size=args.batch_size
                        )
                        .score_loaded()
                        .items()
                        if k in datasets
                    }
                    scorer.seconds[split] += time.perf_counter() - e0
        else:
            state = merge_state_dicts(row.recipe, states)
            merge_seconds += time.perf_counter() - t0
            row.scores = scorer.score(state)
        print(
            f"  scored {row.name}: " + ", ".join(f"{s} {mean(v.values()):.2f}" for s, v in row.scores.items()),
            flush=True,
        )
    print()
    print_table(rows, datasets, args.splits, False, short)
    timing = {
        "setup_s": round(scorer.setup_seconds, 1),
        "merge_s": round(merge_seconds, 1),
        "eval_s": {s: round(v, 1) for s, v in scorer.seconds.items()},
        "models_scored": len(rows),
    }
    print(f"\nTimes: {json.dumps(timing)}", flush=True)
    return {
        "base": base.model_id,
        "rows": [{"name": r.name, "family": r.family, "scores": r.scores} for r in rows],
        "timing": timing,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="encoder-5task")
    parser.add_argument("--data-dir", default=os.environ.get("ALLOY_DATA_DIR", "var"))
    parser.add_argument("--split", default="dev,test", help="comma-separated; the first selects, the last reports")
    parser.add_argument("--lambdas", default="0.3,0.4,0.5,0.7,1.0")
    parser.add_argument("--densities", default="0.2,0.5")
    parser.add_argument("--ties-lambdas", default="0.7,1.0,1.5")  # a disjoint mean: the best λ can exceed 1
    parser.add_argument("--dare-drop", type=float, default=0.9)
    parser.add_argument("--dare-lambdas", default="0.3,0.5")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--family", default=None, help="only this base model id (presets with several bases)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    args.splits = [s for s in args.split.split(",") if s]
    for name in ("lambdas", "densities", "ties_lambdas", "dare_lambdas"):
        setattr(args, name, [float(x) for x in getattr(args, name).split(",") if x])
    torch.set_num_threads(args.threads)

    started = time.perf_counter()
    manifest = build_preset(args.preset, args.data_dir)
    print(
        f"# merge quality: preset {args.preset} (build {manifest.build_seconds:.0f}s when built; "
        f"ready in {time.perf_counter() - started:.1f}s now)"
    )
    results = []
    bases = [m for m in manifest.models if m.role == "base" and (args.family is None or m.model_id == args.family)]
    for base in bases:
        tunes = manifest.finetunes(base.model_id)
        kinds = {manifest.dataset(t.task).task.get("type") for t in tunes if t.task}
        if kinds <= {"perplexity"} and any(d.task.get("type") == "perplexity" for d in manifest.datasets):
            results.append(run_perplexity_family(manifest, base, args))
        elif len(tunes) >= 2 and kinds == {"classification"}:
            results.append(run_family(manifest, base, args))
        else:
            print(f"\n(skipping {base.model_id}: needs >= 2 fine-tunes scored by accuracy, or perplexity sets)")
    print(f"\nTotal bench time {time.perf_counter() - started:.1f}s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
