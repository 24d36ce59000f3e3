"""Differential benchmark: the same mergekit recipes through mergekit 0.1.5 (its own venv, ``mergekit-yaml``) and
Alloy (``alloy merge``), on the same pico models built with ``transformers`` config classes, compared per tensor.

    python -m bench.mergekit_diff [--only NAME,NAME] [--root DIR]

For each recipe it prints: whether the two outputs have the same tensors and config layer count, the largest
absolute difference, how many elements differ, and (each tool run in its own process, one after the other) the
wall-time and peak-RSS ratios Alloy/mergekit. Deterministic recipes must agree within 1e-6, whatever their dtype
(a bfloat16 or float16 recipe is computed in that dtype as mergekit computes it, so the same rounding steps give
the same bits); random recipes (DARE, DELLA) draw different bits in the two tools, so their kept fraction and the
L1 norm of ``merged - base`` are compared instead (within 0.5%). A recipe with keys its method does not read
(``ignored``) must merge in both tools, with Alloy's output naming each key in a warning; a refused recipe must be
refused by Alloy naming the key.

mergekit's Python is ``$ALLOY_MERGEKIT_PYTHON`` or ``/work/mkvenv/bin/python``; the project never imports it.
The recipes (:mod:`bench.mergekit_recipes`) reconstruct every configuration of mergekit's
``tests/test_basic_merges.py`` and every ``examples/*.yml``, plus the recipe forms Alloy documents.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.mergekit_recipes import CASES, Case
from bench.pico_models import build_pico, model_class, pico_family  # noqa: F401

DEFAULT_MERGEKIT_PYTHON = "/work/mkvenv/bin/python"
DETERMINISTIC_ATOL = 1e-6
RANDOM_RTOL = 0.005


def mergekit_python() -> Path | None:
    """mergekit's interpreter when one is installed (env ``ALLOY_MERGEKIT_PYTHON`` first), else None."""
    candidate = Path(os.environ.get("ALLOY_MERGEKIT_PYTHON", DEFAULT_MERGEKIT_PYTHON))
    if not candidate.is_file():
        return None
    probe = subprocess.run([str(candidate), "-c", "import mergekit"], capture_output=True)
    return candidate if probe.returncode == 0 else None


# --- running ----------------------------------------------------------------------------------------------------


def trimmed_inputs(case: Case, models: dict[str, Path]) -> tuple[list[Path], Any, str, Any] | None:
    """What :func:`compare` needs to tell top-k threshold ties: the trimmed models, their density (a per-tensor
    plan of them when the recipe has a density gradient or filter: ``density: None`` in the case), the selection
    and the dtype the recipe computes in."""
    if not case.trimmed:
        return None
    from alloy.merge.mergekit import load_recipe_yaml

    trimmed = [models[m] for m in case.trimmed]
    density = case.density if case.density is not None else planned_densities(case.text(models), trimmed)
    compute = getattr(torch, load_recipe_yaml(case.text(models)).compute_dtype or "float32")
    return trimmed, density, case.selection, compute


def run_measured(command: list[str], cwd: Path | None = None) -> tuple[float, int, str]:
    """``(wall seconds, peak RSS bytes, output)`` of one child process (its own rusage, from ``wait4``)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = process.stdout.read().decode(errors="replace") if process.stdout else ""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({process.returncode}):\n{output[-3000:]}")
    return wall, usage.ru_maxrss * 1024, output


def mergekit_command(python: Path, config: Path, out: Path) -> list[str]:
    return [str(python.parent / "mergekit-yaml"), str(config), str(out), *mergekit_options(out.parent / "lora-cache")]


def mergekit_options(lora_cache: Path) -> list[str]:
    """mergekit-yaml's options for every run (it merges LoRA inputs into full copies under ``lora_cache``)."""
    return [
        "--allow-crimes",
        "--no-copy-tokenizer",
        "--quiet",
        "--random-seed",
        "0",
        "--lora-merge-cache",
        str(lora_cache),
    ]


def alloy_command(config: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "alloy.cli.main", "merge", str(config), str(out), "--quiet"]


BATCH_DRIVER = """
import json, sys, traceback
from mergekit.scripts.run_yaml import main
failed = 0
options = json.load(open(sys.argv[2]))
for config, out in json.load(open(sys.argv[1])):
    try:
        main.main([config, out, *options], standalone_mode=False)
    except Exception:
        failed += 1
        print("FAILED", config, file=sys.stderr)
        traceback.print_exc()
sys.exit(1 if failed else 0)
"""


def run_mergekit_batch(python: Path, jobs: list[tuple[Path, Path]], scratch: Path) -> str:
    """Every (config, out) through mergekit-yaml's own command function in one mergekit process (one import of
    torch for all of them: what keeps the conformance test short). One failing recipe does not stop the others."""
    listing = scratch / "mergekit-jobs.json"
    listing.write_text(json.dumps([[str(c), str(o)] for c, o in jobs]))
    options = scratch / "mergekit-options.json"
    options.write_text(json.dumps(mergekit_options(scratch / "lora-cache")))
    driver = scratch / "mergekit_batch.py"
    driver.write_text(BATCH_DRIVER)
    result = subprocess.run([str(python), str(driver), str(listing), str(options)], capture_output=True, text=True)
    return result.stderr if result.returncode != 0 else ""  # the failed recipes have no output folder


# --- comparing --------------------------------------------------------------------------------------------------


def load_folder(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    weights: dict[str, Any] = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


def layer_count(folder: Path) -> int | None:
    config = json.loads((Path(folder) / "config.json").read_text())
    return next((config[k] for k in ("num_hidden_layers", "n_layer") if isinstance(config.get(k), int)), None)


def compare(
    alloy_dir: Path,
    mergekit_dir: Path,
    *,
    random: bool,
    base_dir: Path | None,
    trimmed: tuple[list[Path], Any, str, Any] | None = None,
) -> dict[str, Any]:
    """Per-tensor comparison; for random recipes, the kept fraction and L1 norm of ``merged - base`` too.
    Each differing element is explained or not: within 1e-6, or in a bfloat16 / float16 output, ``ulp`` when the
    two values are at most one rounding step (+1e-6) apart (float32 results a hair apart that round different ways), ``ties`` when ``trimmed``
    (the folders of the models a TIES-style top-k trimmed at one density) has a model whose task vector is there
    exactly at its top-k threshold (mergekit's argsort picks among equal magnitudes unstably, Alloy by position)."""
    ours, theirs = load_folder(alloy_dir), load_folder(mergekit_dir)
    report: dict[str, Any] = {
        "same_tensors": set(ours) == set(theirs),
        "only_alloy": sorted(set(ours) - set(theirs)),
        "only_mergekit": sorted(set(theirs) - set(ours)),
        "layers": (layer_count(alloy_dir), layer_count(mergekit_dir)),
        "dtypes_equal": all(ours[n].dtype == theirs[n].dtype for n in set(ours) & set(theirs)),
        "max_abs_diff": 0.0,
        "elements_differing": 0,
        "elements": 0,
        "ulp": 0,
        "ties": 0,
        "unexplained": 0,
    }
    inputs = None if trimmed is None else ([load_folder(f) for f in trimmed[0]], load_folder(base_dir))
    for name in sorted(set(ours) & set(theirs)):
        a, b = ours[name], theirs[name]
        if a.shape != b.shape:
            report["max_abs_diff"] = float("inf")
            continue
        diff = (a.double() - b.double()).abs()
        report["max_abs_diff"] = max(report["max_abs_diff"], float(diff.max()) if diff.numel() else 0.0)
        differs = diff > 0
        report["elements_differing"] += int(differs.sum())
        report["elements"] += diff.numel()
        if not bool(differs.any()) or a.dtype != b.dtype:
            continue
        step = rounding_step(a, b) if a.dtype in HALF_MANTISSA else 0.0
        ulp = differs & (diff <= step + DETERMINISTIC_ATOL)
        tie = (
            differs & ~ulp & at_threshold(name, trimmed[3], inputs, trimmed[1], trimmed[2]) if trimmed else ulp & False
        )
        report["ulp"] += int((ulp & (diff > DETERMINISTIC_ATOL)).sum())
        report["ties"] += int(tie.sum())
        report["unexplained"] += int((differs & ~ulp & ~tie).sum())
    if random and base_dir is not None:
        base = load_folder(base_dir)
        for label, merged in (("alloy", ours), ("mergekit", theirs)):
            kept = total = 0
            l1 = 0.0
            for name, tensor in merged.items():
                if name in base and base[name].shape == tensor.shape and tensor.is_floating_point():
                    delta = tensor.double() - base[name].double()
                    kept += int((delta != 0).sum())
                    total += delta.numel()
                    l1 += float(delta.abs().sum())
            report[f"{label}_kept_fraction"] = kept / max(total, 1)
            report[f"{label}_l1"] = l1
        report["kept_rel_diff"] = abs(report["alloy_kept_fraction"] / report["mergekit_kept_fraction"] - 1)
        report["l1_rel_diff"] = abs(report["alloy_l1"] / report["mergekit_l1"] - 1)
    report["ok"] = verdict(report, random)
    return report


HALF_MANTISSA = {torch.bfloat16: 7, torch.float16: 10}  # explicit mantissa bits


def rounding_step(a: Any, b: Any) -> Any:
    """One unit in the last place of the dtype at the larger of ``|a|``, ``|b|`` (float64): how far apart two
    values rounded from float32 results within 1e-6 of each other can land (plus that 1e-6)."""
    larger = torch.maximum(a.double().abs(), b.double().abs()).clamp_min(torch.finfo(a.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(larger)) - HALF_MANTISSA[a.dtype])


def planned_densities(recipe_text: str, trimmed: list[Path]) -> dict[str, list[float]]:
    """Per output tensor, the density each of the ``trimmed`` models gets (gradients and filters resolved by
    Alloy's plan, for a ``models:`` recipe whose tensors keep their names)."""
    from alloy.merge.mergekit import load_recipe_yaml
    from alloy.merge.plan import build_plan, layout_from_manifest
    from alloy.merge.recipe import validate_recipe
    from alloy.merge.tensor_merge import resolve_task_parameters
    from alloy.model_manifest import read_manifest

    recipe = validate_recipe(load_recipe_yaml(recipe_text))
    plan = build_plan(recipe, {m: layout_from_manifest(read_manifest(m)) for m in recipe.model_ids})
    wanted = [str(path) for path in trimmed]
    densities = {}
    for task in plan.tasks:
        _, per_input = resolve_task_parameters(plan, task)
        by_model = {model: params.get("density", 1.0) for (model, _), params in zip(task.sources, per_input)}
        densities[task.output_name] = [float(by_model[m]) for m in wanted]
    return densities


def at_threshold(name: str, dtype: Any, inputs: Any, density: Any, kind: str = "magnitude") -> Any:
    """Where a top-k selection both tools make has a tie at its threshold: ``magnitude``, some trimmed model's task
    vector (``density`` one for all, or per tensor name one per model) (in ``dtype``, as both tools compute it) has exactly the magnitude of its
    ``k = max(1, int(density * n))``-th largest entry; ``variance`` (SCE), the variance of the task vectors across
    the models equals the ``int(nonzero * density)``-th largest variance (the whole tensor, see below)."""
    models, base = inputs
    vectors = [model[name].to(dtype) - base[name].to(dtype) for model in models]
    if kind == "variance":
        variance = torch.var(torch.stack(vectors), dim=0, unbiased=False).float()
        k = int(int(torch.count_nonzero(variance)) * density)
        if k == 0:
            return torch.zeros_like(variance, dtype=torch.bool)
        threshold = variance.reshape(-1).topk(k).values[-1]
        # which of the tied entries are selected also changes SCE's weights, means over the whole tensor: a tie that
        # straddles the cut explains a difference anywhere in the tensor
        straddles = int((variance > threshold).sum()) < k < int((variance >= threshold).sum())
        return torch.ones_like(variance, dtype=torch.bool) if straddles else variance == threshold
    found = torch.zeros(base[name].shape, dtype=torch.bool)
    for index, vector in enumerate(vectors):
        magnitude = vector.abs().float()
        fraction = density if isinstance(density, float) else density[name][index]
        k = max(1, int(fraction * magnitude.numel()))
        found |= magnitude == magnitude.reshape(-1).topk(k).values[-1]
    return found


def verdict(report: dict[str, Any], random: bool) -> bool:
    if not report["same_tensors"] or report["layers"][0] != report["layers"][1] or not report["dtypes_equal"]:
        return False
    if random:
        return report["kept_rel_diff"] <= RANDOM_RTOL and report["l1_rel_diff"] <= RANDOM_RTOL
    return report["unexplained"] == 0  # float32: within 1e-6; half precision: rounding neighbours or top-k ties


# --- the benchmark ----------------------------------------------------------------------------------------------


def verdict_label(ok: bool, case: Case) -> str:
    return "yes" if ok else ("known" if case.known_difference else "NO")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/tmp/alloy-mergekit-diff"))
    parser.add_argument("--only", default="", help="comma-separated case names")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    python = mergekit_python()
    if python is None:
        sys.exit("mergekit is not installed (set ALLOY_MERGEKIT_PYTHON to a python with mergekit 0.1.5)")
    wanted = {n for n in args.only.split(",") if n}
    cases = [c for c in CASES if not wanted or c.name in wanted]
    args.root.mkdir(parents=True, exist_ok=True)
    families = {arch: pico_family(args.root / "models", arch) for arch in sorted({c.arch for c in cases})}
    header = (
        f"{'recipe':30} {'origin':22} {'tensors':8} {'layers':7} {'max|diff|':>10} {'differ':>14} {'ulp':>5} {'ties':>5} "
        f"{'kept/L1 rel':>13} {'time x':>7} {'RSS x':>6} ok"
    )
    print(header)
    print("-" * len(header))
    for case in cases:
        models = families[case.arch]
        work = args.root / "runs" / case.name
        subprocess.run(["rm", "-rf", str(work)], check=True)
        work.mkdir(parents=True)
        config = work / "recipe.yml"
        config.write_text(case.text(models))
        if case.refused:
            refusal = subprocess.run(alloy_command(config, work / "alloy"), capture_output=True, text=True)
            said = (refusal.stdout + refusal.stderr).strip().splitlines()[-1:] or [""]
            theirs = subprocess.run(mergekit_command(python, config, work / "mergekit"), capture_output=True)
            named = refusal.returncode != 0 and case.refused in said[0]
            print(
                f"{case.name:30} {case.origin:22} refused by Alloy naming {case.refused} "
                f"({'yes' if named else 'NO'}); mergekit {'merges it' if theirs.returncode == 0 else 'refuses it too'}"
            )
            continue
        try:
            mk_wall, mk_rss, _ = run_measured(mergekit_command(python, config, work / "mergekit"))
            al_wall, al_rss, al_output = run_measured(alloy_command(config, work / "alloy"))
        except RuntimeError as exc:
            print(f"{case.name:30} {case.origin:22} FAILED: {str(exc).splitlines()[-1][:80]}")
            continue
        warned = all(f"Warning: {field}:" in al_output for field in case.ignored)
        trimmed = trimmed_inputs(case, models)
        report = compare(
            work / "alloy", work / "mergekit", random=case.random, base_dir=models["base"], trimmed=trimmed
        )
        stats = f"{report['kept_rel_diff']:.2%}/{report['l1_rel_diff']:.2%}" if case.random else "-"
        layers = "=" if report["layers"][0] == report["layers"][1] else f"{report['layers']}"
        print(
            f"{case.name:30} {case.origin:22} {'equal' if report['same_tensors'] else 'DIFFER':8} {layers:7} "
            f"{report['max_abs_diff']:>10.2e} {report['elements_differing']:>6}/{report['elements']:<7} "
            f"{report['ulp']:>5} {report['ties']:>5} "
            f"{stats:>13} {al_wall / mk_wall:>7.2f} {al_rss / mk_rss:>6.2f} {verdict_label(report['ok'] and warned, case)}"
            + (f"  (warns: {', '.join(case.ignored)})" if case.ignored and warned else "")
        )
        (work / "report.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
