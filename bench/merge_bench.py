"""Merge benchmark: Alloy against its own task-arithmetic floor and against mergekit 0.1.5, same inputs, one run.

    python -m bench.merge_bench [--hidden 768 --intermediate 2048 --layers 4 --vocab 16000] [--tunes 3]
                                [--shard-mb 200] [--methods ties,dare_ties,slerp,della,breadcrumbs_ties]
                                [--mergekit /work/mkvenv/bin/python] [--no-mergekit] [--root DIR] [--keep-models]
                                [--device cpu|cuda] [--reference-device cpu] [--check-estimates] [--pairs 3]
                                [--alloy-args '--workers 8 --threads 1']

Builds (offline, with a fixed seed) a base and ``--tunes`` "fine-tunes" (base + small noise) as sharded fp32
Llama-style checkpoints. Every method is written once as a mergekit YAML recipe, and the very same file is run by
``alloy merge`` and, when mergekit is installed (``/work/mkvenv/bin/python`` or ``--mergekit PYTHON``), by
``mergekit-yaml``. Each run is its own process, timed by ``os.wait4``: wall seconds, CPU seconds (user + system)
and peak RSS of that process alone. Both tools pay their interpreter start and imports.

The floor of a method is ``task_arithmetic`` over the same models: it reads every input once and writes the
output once with the least arithmetic, so ``alloy / floor`` is the price of the method's own maths. Deterministic
methods are also compared tensor by tensor with mergekit's output (max |alloy - mergekit|).

``--check-estimates`` runs ``alloy merge --dry-run --json`` before each Alloy merge and prints estimate / measured
for peak RSS, disk and wall time (the issue's bar: within 25%). ``--device cuda`` runs Alloy's merges (floor
included) on the GPU through the same code path; the estimates are calibrated for the CPU. mergekit is found at
``--mergekit`` or ``$ALLOY_MERGEKIT_PYTHON``; ``tsv`` and ``iso_cts`` (Alloy only) run without it.
``--pairs N`` takes Alloy's ratios to its floor as the median of N adjacent floor-then-method runs (a shared VM's
speed drifts over minutes; the table's single floor puts that drift into every ratio).
``--reference-device cpu`` (with ``--device cuda``) also runs every Alloy merge on the CPU, as the tool ``alloy@cpu``
with its own floor, and prints max |device - reference| per method: the GPU's speed and its bits against the CPU
path, on the same machine and inputs. The table ends with each method's ratios to the floor and to mergekit.

The default size runs in about two minutes on 2 shared vCPUs; the issue's size is ``--hidden 2048
--intermediate 5632 --layers 4 --vocab 32000`` (1.34 GB per model).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MERGEKIT_PYTHON = Path(os.environ.get("ALLOY_MERGEKIT_PYTHON", "/work/mkvenv/bin/python"))
REPO = Path(__file__).resolve().parent.parent
# method -> (models used: all tunes or one, parameters of each non-base model, global parameters)
METHODS = {
    "ties": ("all", {"weight": 1.0, "density": 0.5}, {"normalize": True}),
    "dare_ties": ("all", {"weight": 1.0, "density": 0.5}, {"normalize": True}),
    "della": ("all", {"weight": 1.0, "density": 0.5, "epsilon": 0.1}, {"lambda": 1.0}),
    "breadcrumbs_ties": ("all", {"weight": 1.0, "density": 0.5, "gamma": 0.01}, {}),
    "sce": ("all", {}, {"select_topk": 0.5}),  # top-k by the variance across models
    "slerp": ("one", {}, {"t": 0.5}),
    "task_arithmetic": ("all", {"weight": 1.0}, {}),
    "tsv": ("all", {"weight": 1.0}, {"lambda": 1.0}),  # SVD of every 2-D delta
    "iso_cts": ("all", {"weight": 1.0}, {"lambda": 1.0}),
}
RANDOM = {"dare_ties", "della"}  # the two tools draw different random masks: no tensor comparison
ALLOY_ONLY = {"tsv", "iso_cts"}  # mergekit 0.1.5 has no such method: Alloy and its floor only


@dataclass
class Usage:
    wall_s: float
    cpu_s: float
    peak_rss: int


# --- models ----------------------------------------------------------------------------------------------------


def build_models(root: Path, args) -> list[Path]:
    """base, tune1..tuneN as sharded safetensors folders (reused when already built with the same shapes)."""
    import torch
    import transformers
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64),
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    names = ["base"] + [f"tune{i + 1}" for i in range(args.tunes)]
    folders = [root / name for name in names]
    stamp = json.dumps([args.hidden, args.intermediate, args.layers, args.vocab, args.shard_mb])
    if all((f / "bench-stamp").is_file() and (f / "bench-stamp").read_text() == stamp for f in folders):
        return folders
    generator = torch.Generator().manual_seed(0)
    base = {name: torch.randn(shape, generator=generator) * 0.02 for name, shape in layer_shapes(args).items()}
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        config.save_pretrained(str(folder))
        tensors = (
            base
            if folder.name == "base"
            else {k: v + torch.randn(v.shape, generator=generator) * 0.002 for k, v in base.items()}
        )
        split = split_torch_state_dict_into_shards(tensors, max_shard_size=args.shard_mb * 1024**2)
        for filename, keys in split.filename_to_tensors.items():
            save_file({k: tensors[k].contiguous() for k in keys}, str(folder / filename), metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        (folder / "bench-stamp").write_text(stamp)
        del tensors
    return folders


def layer_shapes(args) -> dict[str, tuple[int, ...]]:
    h, i = args.hidden, args.intermediate
    shapes = {"model.embed_tokens.weight": (args.vocab, h)}
    for layer in range(args.layers):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        shapes |= {p + f"self_attn.{proj}_proj.weight": (h, h) for proj in "qkvo"}
        shapes |= {
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return shapes | {"model.norm.weight": (h,), "lm_head.weight": (args.vocab, h)}


def recipe_yaml(method: str, folders: list[Path]) -> str:
    scope, model_params, global_params = METHODS[method]
    base, tunes = folders[0], (folders[1:] if scope == "all" else folders[1:2])
    lines = [f"merge_method: {method}", f"base_model: {base}", "models:", f"  - model: {base}"]
    for tune in tunes:
        lines.append(f"  - model: {tune}")
        if model_params:
            lines.append(f"    parameters: {json.dumps(model_params)}")
    if global_params:
        lines.append(f"parameters: {json.dumps(global_params)}")
    return "\n".join(lines + ["dtype: float32", ""])


# --- runs --------------------------------------------------------------------------------------------------------


# Runs each measured command from a fresh, small Python. Linux carries the forking process's high-water RSS into
# the child's ru_maxrss across exec (vfork shares the memory map until exec), so a child spawned straight from
# this bench, which holds models in memory while it builds and compares them, would report the bench's own peak.
# The launcher's own resident set (about 10 MB) is the only thing that leaks into the figure.
LAUNCHER = """
import json, os, subprocess, sys, time
started = time.perf_counter()
process = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
stderr = process.stderr.read()
_, status, usage = os.wait4(process.pid, 0)
print(json.dumps({"code": os.waitstatus_to_exitcode(status), "wall": time.perf_counter() - started,
                  "cpu": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss * 1024,
                  "stderr": stderr.decode(errors="replace")[-3000:]}))
"""


def timed(command: list[str], env: dict | None = None) -> Usage:
    """Run ``command`` in its own process; wall, CPU and peak RSS of that process alone (os.wait4 in a launcher)."""
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER, *command], capture_output=True, text=True, env=env, cwd=REPO, check=True
    )
    report = json.loads(done.stdout)
    if report["code"]:
        raise RuntimeError(f"{command[:3]} failed ({report['code']}):\n{report['stderr']}")
    return Usage(report["wall"], report["cpu"], report["rss"])


def run_alloy(config: Path, out: Path, device: str = "cpu", extra: tuple[str, ...] = ()) -> Usage:
    return timed(
        [sys.executable, "-m", "alloy.cli.main", "merge", str(config), str(out), "--quiet", "--device", device, *extra]
    )


def alloy_estimates(config: Path, extra: tuple[str, ...] = ()) -> dict:
    """``alloy merge --dry-run --json``'s estimates for the recipe (headers only), with the run's own options."""
    command = [sys.executable, "-m", "alloy.cli.main", "merge", "--dry-run", "--json", str(config), *extra]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True)
    return json.loads(done.stdout)["estimates"]


def estimate_note(estimates: dict, usage: Usage, out: Path) -> tuple[str, bool]:
    """estimate / measured for peak RSS, disk (the shards written) and wall time, each within the issue's 25% or
    not; CPU time for information."""
    memory = estimates["peak_memory_bytes"] / usage.peak_rss
    disk = estimates["disk_bytes"] / sum(f.stat().st_size for f in out.glob("*.safetensors"))
    wall = estimates["wall_seconds"] / usage.wall_s
    ok = all(0.75 <= r <= 1.25 for r in (memory, disk, wall))
    cpu = estimates["cpu_seconds"] / usage.cpu_s
    return (
        f"est/measured RSS {memory:.2f} disk {disk:.2f} wall {wall:.2f} (CPU {cpu:.2f}; machine slowness "
        f"{estimates['machine_slowness']:.2f}){'' if ok else ' OUTSIDE 25%'}",
        ok,
    )


def run_mergekit(python: Path, config: Path, out: Path) -> Usage:
    command = [
        str(python.parent / "mergekit-yaml"),
        str(config),
        str(out),
        "--no-copy-tokenizer",
        "--quiet",
        "--allow-crimes",
        "--random-seed",
        "0",
    ]
    return timed(command, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def max_abs_diff(a: Path, b: Path) -> float:
    import torch
    from safetensors import safe_open

    def where(folder: Path) -> dict[str, Path]:
        found = {}
        for shard in folder.glob("*.safetensors"):
            with safe_open(str(shard), "pt") as handle:
                found |= {name: shard for name in handle.keys()}
        return found

    in_a, in_b = where(a), where(b)
    if set(in_a) != set(in_b):
        return float("inf")
    worst = 0.0
    for name, shard in in_a.items():
        with safe_open(str(shard), "pt") as fa, safe_open(str(in_b[name]), "pt") as fb:
            diff = fa.get_tensor(name).to(torch.float32) - fb.get_tensor(name).to(torch.float32)
            worst = max(worst, float(diff.abs().max()))
    return worst


def warm_page_cache(folders: list[Path]) -> None:
    """Read every input once so that no run pays the first read from disk and the others do not."""
    for shard in (s for f in folders for s in f.glob("*.safetensors")):
        with shard.open("rb") as handle:
            while handle.read(1 << 26):
                pass


def mergekit_python(args) -> Path | None:
    if args.no_mergekit:
        return None
    python = Path(args.mergekit) if args.mergekit else DEFAULT_MERGEKIT_PYTHON
    return python if (python.parent / "mergekit-yaml").is_file() else None


# --- report ----------------------------------------------------------------------------------------------------


def row(method: str, tool: str, usage: Usage, floor: Usage, note: str = "") -> str:
    return (
        f"{method:17s} {tool:9s} {usage.wall_s:7.1f} {usage.cpu_s:7.1f} {usage.peak_rss / 1e9:6.2f} "
        f"{usage.wall_s / floor.wall_s:6.2f}x {usage.cpu_s / floor.cpu_s:6.2f}x "
        f"{usage.peak_rss / floor.peak_rss:6.2f}x  {note}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/tmp/alloy-merge-bench"))
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--tunes", type=int, default=3, help="fine-tuned models besides the base")
    parser.add_argument("--shard-mb", type=int, default=200)
    parser.add_argument("--methods", default="ties,dare_ties,slerp,della,breadcrumbs_ties")
    parser.add_argument("--mergekit", help="mergekit's Python (its mergekit-yaml sits beside it)")
    parser.add_argument("--no-mergekit", action="store_true")
    parser.add_argument("--keep-models", action="store_true")
    parser.add_argument("--device", default="cpu", help="alloy merge --device (cpu, cuda): the same code path")
    parser.add_argument(
        "--reference-device", help="also run Alloy on this device (cpu) and compare the outputs with --device's"
    )
    parser.add_argument(
        "--check-estimates", action="store_true", help="compare each Alloy run with its dry run's estimates"
    )
    parser.add_argument(
        "--alloy-args",
        default="",
        help="more options for every `alloy merge` run, floors included (e.g. '--workers 8 --threads 1')",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="Alloy's ratios to its floor as the median of this many adjacent floor-then-method pairs",
    )
    args = parser.parse_args()
    args.alloy_extra = tuple(shlex.split(args.alloy_args))

    started = time.perf_counter()
    args.root.mkdir(parents=True, exist_ok=True)
    folders = build_models(args.root, args)
    size = sum(s.stat().st_size for s in folders[0].glob("*.safetensors"))
    shards = len(list(folders[0].glob("*.safetensors")))
    python = mergekit_python(args)
    load = os.getloadavg()
    print(
        f"models: base + {args.tunes} tunes, {size / 1e9:.2f} GB fp32 each in {shards} shards "
        f"(hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}); built/found in "
        f"{time.perf_counter() - started:.0f}s; {os.cpu_count()} CPUs, load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
        f"mergekit: {python or 'not run'}; alloy merge {' '.join(args.alloy_extra) or '(defaults)'}",
        flush=True,
    )
    print(
        f"{'method':17s} {'tool':9s} {'wall s':>7s} {'cpu s':>7s} {'RSS GB':>6s} {'wall/floor':>7s} "
        f"{'cpu/floor':>7s} {'RSS/floor':>7s}",
        flush=True,
    )
    floors: dict[tuple[str, str], Usage] = {}
    summary: dict[str, dict[str, float]] = {}
    misses = 0
    reference = f"alloy@{args.reference_device}" if args.reference_device else None
    devices = {"alloy": args.device} | ({reference: args.reference_device} if reference else {})
    tools = [*devices, *(["mergekit"] if python else [])]
    for method in args.methods.split(","):
        scope = METHODS[method][0]
        for tool in tools:
            if (scope, tool) not in floors:
                floor_config = args.root / f"floor-{scope}.yml"
                floor_yaml = recipe_yaml("task_arithmetic", folders if scope == "all" else folders[:2])
                floor_config.write_text(floor_yaml)
                floors[(scope, tool)] = run_one(tool, python, floor_config, args, folders, devices.get(tool))
                floor = floors[(scope, tool)]
                print(row(f"floor:{scope}", tool, floor, floor), flush=True)
        config = args.root / f"{method}.yml"
        config.write_text(recipe_yaml(method, folders))
        outputs: dict[str, Path] = {}
        usages: dict[str, Usage] = {}
        for tool in [t for t in tools if t in devices or method not in ALLOY_ONLY]:
            out = args.root / f"out-{method}-{tool}"
            shutil.rmtree(out, ignore_errors=True)
            estimates = alloy_estimates(config, args.alloy_extra) if tool == "alloy" and args.check_estimates else None
            warm_page_cache(folders)
            usage = (
                run_alloy(config, out, devices[tool], args.alloy_extra)
                if tool in devices
                else run_mergekit(python, config, out)
            )
            outputs[tool], usages[tool] = out, usage
            note = ""
            if tool == reference:  # the same per-tensor seeds: random methods too draw the same masks
                summary[method]["wall/ref"] = usages["alloy"].wall_s / usage.wall_s
                note = f"max|{args.device}-{args.reference_device}| {max_abs_diff(outputs['alloy'], out):.1e}"
            if estimates is not None:
                note, ok = estimate_note(estimates, usage, out)
                misses += not ok
            if tool == "alloy":
                floor = floors[(scope, tool)]
                summary[method] = {"wall/TA": usage.wall_s / floor.wall_s, "cpu/TA": usage.cpu_s / floor.cpu_s}
                if args.pairs > 1:
                    pairs = floor_pairs(args, scope, config, folders, usage, floor)
                    summary[method] |= {key: statistics.median(values) for key, values in pairs.items()}
                    note = "; ".join(part for part in (note, pairs_note(pairs)) if part)
            if tool == "mergekit":
                alloy_usage = usages["alloy"]
                summary[method] |= {
                    "wall/mk": alloy_usage.wall_s / usage.wall_s,
                    "cpu/mk": alloy_usage.cpu_s / usage.cpu_s,
                    "RSS/mk": alloy_usage.peak_rss / usage.peak_rss,
                }
                note = (
                    f"alloy/mergekit wall {alloy_usage.wall_s / usage.wall_s:.2f}x "
                    f"CPU {alloy_usage.cpu_s / usage.cpu_s:.2f}x RSS {alloy_usage.peak_rss / usage.peak_rss:.2f}x"
                )
                if method not in RANDOM:
                    note += f", max|alloy-mergekit| {max_abs_diff(outputs['alloy'], out):.1e}"
            print(row(method, tool, usage, floors[(scope, tool)], note), flush=True)
        for out in outputs.values():
            shutil.rmtree(out, ignore_errors=True)
    print(
        "\nAlloy ratios (TA: Alloy's task-arithmetic floor; mk: mergekit on the same recipe; "
        "ref: Alloy on --reference-device)"
    )
    columns = ("wall/TA", "cpu/TA", "wall/mk", "cpu/mk", "RSS/mk", "wall/ref")
    print(f"{'method':17s}" + "".join(f"{c:>9s}" for c in columns))
    for method, ratios in summary.items():
        print(f"{method:17s}" + "".join(f"{ratios[c]:9.2f}" if c in ratios else f"{'-':>9s}" for c in columns))
    if args.check_estimates:
        print(f"dry-run estimates outside 25%: {misses}")
    load = os.getloadavg()
    print(f"done in {time.perf_counter() - started:.0f}s; load at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if not args.keep_models:
        shutil.rmtree(args.root, ignore_errors=True)


def floor_pairs(args, scope: str, config: Path, folders: list[Path], usage: Usage, floor: Usage) -> dict:
    """Alloy's ratios to its floor over ``--pairs`` adjacent floor-then-method runs, the first the table's own.
    WHY: a shared VM's speed drifts by tens of percent over minutes (the floor measured 3.6 and 4.9 s on one VM
    within the hour), and a floor run once for all the methods puts that drift into every ratio."""
    walls, cpus = [usage.wall_s / floor.wall_s], [usage.cpu_s / floor.cpu_s]
    out = args.root / "out-pair"
    for _ in range(args.pairs - 1):
        again_floor = run_one("alloy", None, args.root / f"floor-{scope}.yml", args, folders, args.device)
        shutil.rmtree(out, ignore_errors=True)
        warm_page_cache(folders)
        again = run_alloy(config, out, args.device, args.alloy_extra)
        shutil.rmtree(out, ignore_errors=True)
        walls.append(again.wall_s / again_floor.wall_s)
        cpus.append(again.cpu_s / again_floor.cpu_s)
    return {"wall/TA": walls, "cpu/TA": cpus}


def pairs_note(pairs: dict) -> str:
    return f"{len(pairs['wall/TA'])} adjacent pairs: " + ", ".join(
        f"{key} median {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
        for key, values in pairs.items()
    )


def run_one(tool: str, python: Path | None, config: Path, args, folders: list[Path], device: str | None) -> Usage:
    """One floor run: Alloy on ``device``, or mergekit when ``device`` is None."""
    out = args.root / f"out-floor-{tool}"
    shutil.rmtree(out, ignore_errors=True)
    warm_page_cache(folders)
    usage = (
        run_alloy(config, out, device, args.alloy_extra) if device is not None else run_mergekit(python, config, out)
    )
    shutil.rmtree(out, ignore_errors=True)
    return usage


if __name__ == "__main__":
    main()
