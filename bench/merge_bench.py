"""Merge benchmark: Alloy's streaming executor against a naive merge, on three fp32 Llama-style models.

    python bench/merge_bench.py [--root /tmp/alloy-bench] [--strategies ties,dare,slerp,task_arithmetic]
                                [--mergekit /path/to/mergekit-yaml]

Builds, offline and once, three ~1.3 GB fp32 models (hidden 2048, 8 layers, vocab 32000): a base and two
"fine-tunes" (base + small noise). For each strategy it runs, each in its own process so that peak RSS
(``ru_maxrss`` of that process) is not polluted by the other:

* baseline: the naive way: load every tensor of every model (``safetensors.torch.load_file``), compute with the
  textbook maths as mergekit 0.1.5 writes it (full ``argsort`` for the TIES trim, stacked task vectors,
  ``torch.bernoulli`` for DARE), then ``save_file`` the whole result;
* alloy: ``alloy.merge.executor.execute_merge`` (lazy pread reads, bounded in-flight tensors, selection-based
  trim, shards written as tensors finish).

It prints wall time and peak RSS for both and the Alloy/baseline ratios, and checks that Alloy's tensors equal
the baseline's for the deterministic strategies. With ``--mergekit`` it also times the real ``mergekit-yaml``
(installed in a separate environment) on the same TIES recipe and compares its tensors with Alloy's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, LAYERS, VOCAB, INTERMEDIATE, HEADS = 2048, 8, 32000, 1280, 16
STRATEGIES = {
    "ties": {"strategy": "ties", "models": ["base", "tune1", "tune2"], "parameters": {"density": 0.5}},
    "dare": {"strategy": "dare", "models": ["base", "tune1", "tune2"], "parameters": {"drop_rate": 0.5}},
    "slerp": {"strategy": "slerp", "models": ["base", "tune1"], "parameters": {"t": 0.5}},
    "task_arithmetic": {
        "strategy": "task_arithmetic",
        "models": ["base", "tune1", "tune2"],
        "parameters": {"lambda": 1.0},
    },
}
DETERMINISTIC = {"ties", "slerp", "task_arithmetic"}  # DARE's random masks differ by construction


# --- model building ----------------------------------------------------------------------------------------------


def layer_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,)}
        for proj in ("q", "k", "v", "o"):
            shapes[p + f"self_attn.{proj}_proj.weight"] = (HIDDEN, HIDDEN)
        shapes |= {
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
    shapes |= {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    return shapes


def build_models(root: Path) -> dict[str, Path]:
    import torch
    import transformers
    from safetensors.torch import save_file

    paths = {name: root / name for name in ("base", "tune1", "tune2")}
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        architectures=["LlamaForCausalLM"],
    )
    if all((p / "model.safetensors").exists() for p in paths.values()):
        for path in paths.values():
            config.save_pretrained(str(path))
        return paths
    generator = torch.Generator().manual_seed(0)
    base = {name: (torch.randn(shape, generator=generator) * 0.02) for name, shape in layer_shapes().items()}
    for name, path in paths.items():
        path.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(str(path))
        if name == "base":
            tensors = base
        else:
            tensors = {k: v + torch.randn(v.shape, generator=generator) * 0.002 for k, v in base.items()}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        del tensors
    return paths


# --- the naive baseline (mergekit 0.1.5's maths, everything in memory) -------------------------------------------


def naive_merge(spec: dict, paths: dict[str, Path], out_dir: Path, seed: int = 0) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    models = {m: load_file(str(paths[m] / "model.safetensors")) for m in spec["models"]}
    base = models[spec["models"][0]]
    others = [models[m] for m in spec["models"][1:]]
    params = spec["parameters"]
    merged = {}
    for name, b in base.items():
        xs = [o[name] for o in others]
        if spec["strategy"] == "slerp":
            merged[name] = naive_slerp(b, xs[0], params["t"])
        else:
            deltas = torch.stack([x - b for x in xs])
            if spec["strategy"] == "ties":
                deltas = torch.stack([naive_magnitude(d, params["density"]) for d in deltas])
                sign = deltas.sign()
                majority = (deltas.sum(dim=0) >= 0).to(b.dtype) * 2 - 1
                mask = (sign == majority).to(b.dtype)
                mixed = (deltas * mask).sum(dim=0)
                divisor = mask.sum(dim=0)
                divisor[divisor == 0] = 1
                merged[name] = b + mixed / divisor
            elif spec["strategy"] == "dare":
                keep = torch.bernoulli(torch.full_like(deltas, 1 - params["drop_rate"]))
                merged[name] = b + (deltas * keep / (1 - params["drop_rate"])).sum(dim=0)
            else:
                merged[name] = b + params["lambda"] * deltas.sum(dim=0)
    out_dir.mkdir(parents=True)
    save_file(merged, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def naive_magnitude(delta, density):
    import torch

    k = max(1, int(density * delta.numel()))
    mask = torch.zeros(delta.numel(), dtype=delta.dtype)
    mask[torch.argsort(delta.abs().reshape(-1), descending=True)[:k]] = 1
    return delta * mask.reshape_as(delta)


def naive_slerp(v0, v1, t, eps=1e-8):
    import torch

    n0, n1 = v0 / max(v0.norm().item(), eps), v1 / max(v1.norm().item(), eps)
    dot = float((n0 * n1).sum().clamp(-1, 1))
    if abs(dot) > 0.9995:
        return (1 - t) * v0 + t * v1
    theta = torch.acos(torch.tensor(dot)).item()
    s = torch.sin(torch.tensor(theta)).item()
    return (torch.sin(torch.tensor((1 - t) * theta)).item() / s) * v0 + (
        torch.sin(torch.tensor(t * theta)).item() / s
    ) * v1


# --- child processes ------------------------------------------------------------------------------------------------


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child(kind: str, strategy: str, root: Path, out_dir: Path, compare_with: str | None) -> None:
    paths = {n: root / n for n in ("base", "tune1", "tune2")}
    spec = STRATEGIES[strategy]
    started = time.perf_counter()
    if kind == "baseline":
        naive_merge(spec, paths, out_dir)
    else:
        from alloy.merge.executor import execute_merge
        from alloy.merge.recipe import MergeRecipe, ModelRef

        recipe = MergeRecipe(
            strategy=spec["strategy"], models=[ModelRef(model=m) for m in spec["models"]], parameters=spec["parameters"]
        )
        execute_merge(recipe, paths, out_dir)
    wall = time.perf_counter() - started
    report = {"wall_s": wall, "peak_rss": peak_rss_bytes()}
    if compare_with:  # after the measurements: comparing reads both outputs
        report["max_abs_diff"] = max_abs_diff(out_dir, Path(compare_with))
    print("RESULT " + json.dumps(report), flush=True)


def max_abs_diff(a: Path, b: Path) -> float:
    from safetensors import safe_open

    def handles(folder):
        return {name: f for f in folder.glob("*.safetensors") for name in safe_open(str(f), "pt").keys()}

    files_a, files_b = handles(a), handles(b)
    if set(files_a) != set(files_b):
        return float("inf")
    worst = 0.0
    for name in files_a:
        with safe_open(str(files_a[name]), "pt") as fa, safe_open(str(files_b[name]), "pt") as fb:
            worst = max(worst, (fa.get_tensor(name).float() - fb.get_tensor(name).float()).abs().max().item())
    return worst


def run_child(kind: str, strategy: str, root: Path, out_dir: Path, compare_with: Path | None = None) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--strategy",
        strategy,
        "--root",
        str(root),
        "--out",
        str(out_dir),
    ]
    if compare_with:
        command += ["--compare-with", str(compare_with)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:])


def run_mergekit(mergekit: str, root: Path, out_dir: Path) -> dict:
    recipe = root / "ties-mergekit.yml"
    recipe.write_text(
        f"merge_method: ties\nbase_model: {root / 'base'}\nmodels:\n  - model: {root / 'base'}\n"
        + "".join(f"  - model: {root / m}\n    parameters: {{weight: 1.0, density: 0.5}}\n" for m in ("tune1", "tune2"))
        + "parameters: {normalize: true}\ndtype: float32\n"
    )
    # A fresh wrapper process waits for mergekit, so RUSAGE_CHILDREN there is mergekit's own peak.
    wrapper = (
        "import json, resource, subprocess, sys, time; t = time.perf_counter(); "
        "p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True); "
        "w = time.perf_counter() - t; sys.stderr.write(p.stderr[-2000:] if p.returncode else ''); "
        "print('RESULT ' + json.dumps({'wall_s': w, 'rc': p.returncode, "
        "'peak_rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", wrapper, mergekit, str(recipe), str(out_dir), "--no-copy-tokenizer"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    if result["rc"]:
        raise RuntimeError(f"mergekit failed: {done.stderr}")
    return result


def warm_page_cache(root: Path) -> None:
    for path in root.glob("*/model.safetensors"):
        with path.open("rb") as handle:
            while handle.read(1 << 26):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/tmp/alloy-bench"))
    parser.add_argument("--strategies", default="ties,dare,slerp,task_arithmetic")
    parser.add_argument("--mergekit", help="path to a mergekit-yaml executable (separate environment)")
    parser.add_argument("--keep-models", action="store_true", help="keep the built models for another run")
    parser.add_argument("--child", choices=["baseline", "alloy"], help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--compare-with", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.strategy, args.root, args.out, args.compare_with)
        return

    args.root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import merge_bench; merge_bench.build_models(__import__('pathlib').Path({str(args.root)!r}))",
        ],
        check=True,
    )
    size = sum(p.stat().st_size for p in args.root.glob("*/model.safetensors")) / 3
    print(
        f"models: 3 x {size / 1e9:.2f} GB fp32 (hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}), "
        f"built/found in {time.perf_counter() - started:.0f}s; {os.cpu_count()} CPUs"
    )
    warm_page_cache(args.root)

    rows = []
    if args.mergekit and "ties" in args.strategies.split(","):
        mk_out = args.root / "out-mergekit"
        shutil.rmtree(mk_out, ignore_errors=True)
        rows.append(("ties", "mergekit", run_mergekit(args.mergekit, args.root, mk_out)))
    for strategy in args.strategies.split(","):
        baseline_out, alloy_out = args.root / f"out-{strategy}-baseline", args.root / f"out-{strategy}-alloy"
        for folder in (baseline_out, alloy_out):
            shutil.rmtree(folder, ignore_errors=True)
        baseline = run_child("baseline", strategy, args.root, baseline_out)
        alloy = run_child(
            "alloy", strategy, args.root, alloy_out, compare_with=baseline_out if strategy in DETERMINISTIC else None
        )
        rows += [(strategy, "baseline", baseline), (strategy, "alloy", alloy)]
        if strategy == "ties" and args.mergekit:
            alloy["vs_mergekit"] = max_abs_diff(alloy_out, args.root / "out-mergekit")
        print_row(strategy, baseline, alloy)
        shutil.rmtree(baseline_out, ignore_errors=True)
        shutil.rmtree(alloy_out, ignore_errors=True)
    for _strategy, kind, result in rows:
        if kind == "mergekit":
            print(f"mergekit-yaml ties: wall {result['wall_s']:.1f}s, peak RSS {result['peak_rss'] / 1e9:.2f} GB")
    shutil.rmtree(args.root / "out-mergekit", ignore_errors=True)
    if not args.keep_models:
        shutil.rmtree(args.root, ignore_errors=True)


def print_row(strategy: str, baseline: dict, alloy: dict) -> None:
    line = (
        f"{strategy:16s} baseline {baseline['wall_s']:6.1f}s {baseline['peak_rss'] / 1e9:5.2f} GB | "
        f"alloy {alloy['wall_s']:6.1f}s {alloy['peak_rss'] / 1e9:5.2f} GB | "
        f"ratio wall {alloy['wall_s'] / baseline['wall_s']:.2f}x RSS {alloy['peak_rss'] / baseline['peak_rss']:.2f}x"
    )
    if "max_abs_diff" in alloy:
        line += f" | max|alloy-baseline| {alloy['max_abs_diff']:.2e}"
    if "vs_mergekit" in alloy:
        line += f" | max|alloy-mergekit| {alloy['vs_mergekit']:.2e}"
    print(line, flush=True)


if __name__ == "__main__":
    main()
