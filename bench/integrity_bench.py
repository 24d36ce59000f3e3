"""What verifying a model's sha256 before a merge reads it costs, on one ~500 MB model, in one run.

    python -m bench.integrity_bench [--hidden 1024 --layers 8 --vocab 32000] [--root DIR] [--keep]

Builds (offline, fixed seeds) a base and one "fine-tune" (~500 MB of fp32 safetensors each with the defaults),
registers both in place (files hashed once at registration) and measures, in this process:

- ``verify (first use)``: ``ModelRegistry.local_dir`` of both inputs in a fresh process state: every file
  hashed against its registered sha256 (what a merge, evaluation or evolution replica pays once per model and
  file version);
- ``verify (remembered)``: the same call again: one ``stat`` per file (every later job of that replica);
- ``read``: reading both inputs' files once, sequentially (the floor of any merge);
- ``merge``: ``execute_merge`` of the two (slerp, fp32) into a new folder: what the verification is added to.

It prints each time, the ratios ``verify / merge`` and ``verify / read``, sha256 throughput and the peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path


def _timed(fn):
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def _read_all(folders: list[Path]) -> int:
    total = 0
    for folder in folders:
        for path in sorted(folder.glob("*.safetensors")):
            with open(path, "rb") as handle:
                while chunk := handle.read(8 * 1024 * 1024):
                    total += len(chunk)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--root", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()

    from alloy.merge.executor import execute_merge
    from alloy.merge.recipe import MergeRecipe, ModelRef
    from alloy.registry.models import ModelRegistry
    from alloy.storage.artifacts import ArtifactStore
    from alloy.storage.db import Database
    from alloy.zoo.tiny_models import build_tiny_model

    root = args.root or Path(tempfile.mkdtemp(prefix="alloy-integrity-bench-"))
    size = {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab}
    try:
        base = build_tiny_model(root / "models" / "base", "llama", seed=1, **size)
        tune = build_tiny_model(root / "models" / "tune", "llama", seed=2, base=base, **size)
        model_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
        db = Database(f"sqlite:///{root / 'bench.db'}")
        db.upgrade()
        store = ArtifactStore(root / "artifacts")
        registry = ModelRegistry(db, store, model_roots=[root / "models"], data_dir=root / "var")
        register_s = 0.0
        for model_id, folder in (("base", base), ("tune", tune)):
            seconds, _ = _timed(lambda m=model_id, f=folder: registry.register(m, f, copy_into_store=False))
            register_s += seconds

        fresh = ModelRegistry(db, store, model_roots=[root / "models"], data_dir=root / "var")  # nothing remembered
        verify_s, _ = _timed(lambda: [fresh.local_dir("base"), fresh.local_dir("tune")])
        remembered_s, _ = _timed(lambda: [fresh.local_dir("base"), fresh.local_dir("tune")])
        read_s, read_bytes = _timed(lambda: _read_all([base, tune]))
        recipe = MergeRecipe(
            strategy="slerp",
            base_model="base",
            models=[ModelRef(model="base"), ModelRef(model="tune")],
            parameters={"t": 0.5},
        )
        merge_s, _ = _timed(lambda: execute_merge(recipe, {"base": base, "tune": tune}, root / "out"))
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        db.close()
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    print(f"model size: {model_bytes / 1e6:.0f} MB per input, 2 inputs ({read_bytes / 1e6:.0f} MB read)")
    print(f"registration (2 models, hashed in place): {register_s:.2f}s")
    print(f"verify (first use, 2 inputs):  {verify_s:.2f}s  ({read_bytes / verify_s / 1e6:.0f} MB/s)")
    print(f"verify (remembered, 2 inputs): {remembered_s * 1000:.2f}ms")
    print(f"read (2 inputs, sequential):   {read_s:.2f}s")
    print(f"merge (slerp, 2 inputs) :      {merge_s:.2f}s")
    print(f"ratio verify/merge: {verify_s / merge_s:.3f}   verify/read: {verify_s / read_s:.2f}")
    print(f"peak RSS: {peak_mb:.0f} MB")


if __name__ == "__main__":
    main()
