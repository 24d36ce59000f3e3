"""Scale-out benchmark: the same TIES merge job in one process on one worker node, and fanned out over the
worker nodes of a local multi-node Ray cluster, in one run, through the MergeEngine's own wiring (the job
skeleton, the registry, groups of shards as Ray tasks, the artifact store on S3).

    nice -n 5 python -m bench.scale_bench [--hidden 768 --intermediate 2048 --layers 4 --vocab 16000]
                                          [--tunes 3] [--shard-mb 32] [--workers 2] [--root DIR]

The cluster is a Ray head (no CPU for work: it only coordinates) and ``--workers`` worker nodes of one logical
CPU each, all on this machine, with S3 served by moto on loopback and a SQLite registry (every node is on this
machine; a real cluster uses PostgreSQL). Each node has its own data dir, hence its own model cache.

Runs, in this order: one process cold (its node's cache empty: the inputs are downloaded first), fanned out
cold (every node's cache empty), then both again warm (the inputs cached on every node: only the merge and the
upload of the output), then the fan-out once more at once (its Ray worker processes still alive: no start-up). For each: wall seconds of the job (claim to COMPLETED), the merge's own seconds, and the
peak RSS of the merging processes per node (sampled every 0.2 s: the job process, or the group tasks, of each
node). The coordination overhead of a fanned-out job is its wall time minus its slowest group's: ``start``
(launching the tasks: a Ray worker process importing torch, unless one is idle) and ``publish`` (the index,
config and card, the server-side copy into place and the registration; the one-process job publishes too). The artifact store's bandwidth from this
machine is measured on one model's files: upload into staging, publish (the server-side copy into place), verified
download. The outputs of all runs are compared by the sha256 of every published file (they must be equal).

On this machine's 2 shared vCPUs two workers can at best halve the merge time; the output says so and prints
the load average. The default size runs in a few minutes.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.merge_bench import build_models  # the one model builder of the benches

TASK_MARKERS = ("bench_job", "merge_group_task")


def start_cluster(root: Path, workers: int):
    from alloy.control.nodes import start_ray_worker
    from alloy.control.ray_head import start_ray_head

    # Ray's memory monitor watches the whole (shared) machine: off, or other users' memory kills our workers.
    head = start_ray_head(
        root / "head",
        num_cpus=0,
        include_dashboard=False,
        object_store_bytes=128 * 1024**2,
        extra_env={"RAY_memory_monitor_refresh_ms": "0"},
    )
    nodes: dict = {}
    try:
        for i in range(workers):
            name = f"w{i + 1}"
            nodes[name] = start_ray_worker(
                head,
                name,
                root / name / "ray",
                num_cpus=1,
                object_store_bytes=128 * 1024**2,
                env={"ALLOY_DATA_DIR": str(root / name / "data"), "RAY_memory_monitor_refresh_ms": "0"},
                ready_timeout_s=180,
            )
    except BaseException:
        stop_cluster(head, nodes)
        raise
    return head, nodes


def stop_cluster(head, nodes: dict) -> None:
    from alloy.control.ray_head import stop_ray_head

    for node in nodes.values():
        node.stop(timeout_s=5)
    stop_ray_head(head, timeout_s=5)


def start_s3():
    import boto3
    from moto.server import ThreadedMotoServer

    from alloy.control.ports import pick_port_block

    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    port = pick_port_block(1)[0]
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per S3 request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
    return server, endpoint


class RssSampler:
    """Peak summed RSS of the merging processes of each node (the job task or the group tasks)."""

    def __init__(self, trees: dict[str, psutil.Process]):
        self.trees, self.peak = trees, dict.fromkeys(trees, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for name, root in self.trees.items():
                total = 0
                for proc in _tree(root):
                    try:
                        if any(m in " ".join(proc.cmdline()) for m in TASK_MARKERS):
                            total += proc.memory_info().rss
                    except psutil.Error:
                        continue
                self.peak[name] = max(self.peak[name], total)


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _slowest(merge: dict) -> dict:
    """The fanned-out job's slowest group, with its merge phase (its time less fetch and upload)."""
    slow = max(merge["groups"], key=lambda g: g["seconds"])
    return {**slow, "merge_s": slow["seconds"] - slow["fetch_s"] - slow["upload_s"]}


def store_bandwidth(store, folder: Path, work: Path) -> tuple[float, float, float]:
    """Bytes per second of one model's files: staged (upload), published (copy into place), downloaded (sha256
    verified) - the three moves a fanned-out merge makes through the store."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    staging = store.new_staging()
    started = time.perf_counter()
    entries = [store.stage_file(staging, p.name, p) for p in files]
    staged = time.perf_counter()
    store.publish_staged(staging, "bench/probe", entries)
    published = time.perf_counter()
    store.get_dir("bench/probe", work / "download-probe")
    downloaded = time.perf_counter()
    store.delete_prefix("bench/probe")
    return size / (staged - started), size / (published - staged), size / (downloaded - published)


def run_bench_job(load_settings, job_id: str):
    """One merge job as a MergeEngine replica runs it (same runner, same fan-out wiring); (record, wall s)."""
    import ray

    from alloy.control.merge_fanout import RayGroupLauncher
    from alloy.jobs.merge_fanout import FanoutCoordinator
    from alloy.jobs.merge_runner import MergeJobRunner
    from alloy.jobs.store import JobStore
    from alloy.registry.models import ModelRegistry
    from alloy.storage.artifacts import ArtifactStore
    from alloy.storage.db import Database

    settings = load_settings()
    db = Database.from_settings(settings)
    models = ModelRegistry.from_settings(settings, db, ArtifactStore.from_settings(settings))
    coordinator = FanoutCoordinator(
        models, RayGroupLauncher.for_settings(load_settings, settings), settings.merge, settings.merge_work_dir
    )
    runner = MergeJobRunner(
        JobStore(db),
        models,
        settings.merge_work_dir,
        shard_bytes=settings.merge.shard_bytes,
        fanout=coordinator,
        node=ray.get_runtime_context().get_node_id(),
    )
    started = time.perf_counter()
    record = runner.run(job_id)
    return record.model_dump(mode="json"), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/tmp/alloy-scale-bench"))
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--tunes", type=int, default=3)
    parser.add_argument("--shard-mb", type=int, default=32, help="input and output shard size")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    import ray

    from alloy.config import load_settings
    from alloy.jobs.merge_request import MergeRequest
    from alloy.jobs.records import JobKind
    from alloy.jobs.store import JobStore
    from alloy.registry.models import ModelRegistry
    from alloy.storage.artifacts import ArtifactStore
    from alloy.storage.db import Database

    started = time.perf_counter()
    args.root.mkdir(parents=True, exist_ok=True)
    folders = build_models(args.root / "models", args)
    model_bytes = sum(s.stat().st_size for s in folders[0].glob("*.safetensors"))
    load = os.getloadavg()
    print(
        f"models: base + {args.tunes} tunes, {model_bytes / 1e6:.0f} MB fp32 each; {os.cpu_count()} vCPUs (shared), "
        f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.workers} worker nodes of 1 logical CPU on this machine",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="asb", dir="/tmp"))
    server, endpoint = start_s3()
    try:
        head, nodes = start_cluster(work, args.workers)
    except BaseException:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        raise
    try:
        overrides = {
            "database": {"url": f"sqlite:///{work / 'alloy.db'}"},
            "artifacts": {
                "uri": "s3://bench/alloy",
                "s3": {
                    "endpoint_url": endpoint,
                    "region": "us-east-1",
                    "access_key_id": "bench",
                    "secret_access_key": "bench",
                },
            },
            "model_roots": [str(args.root / "models")],
            "merge": {"shard_bytes": args.shard_mb * 1024**2, "fanout_threshold_bytes": None},
        }
        settings = load_settings(data_dir=str(work / "driver"), **overrides)
        db = Database.from_settings(settings)
        db.upgrade()
        store = ArtifactStore.from_settings(settings)
        models = ModelRegistry.from_settings(settings, db, store)
        for folder in folders:
            models.register(folder.name, folder)
        upload_bw, publish_bw, download_bw = store_bandwidth(store, folders[0], work)
        print(
            f"artifact store (moto S3 on loopback, from this machine): upload {upload_bw / 1e6:.0f} MB/s, "
            f"publish (server-side copy) {publish_bw / 1e6:.0f} MB/s, verified download {download_bw / 1e6:.0f} MB/s",
            flush=True,
        )

        head.apply_env()
        ray.init(address=head.address, log_to_driver=False)
        bench_job = ray.remote(max_calls=1)(run_bench_job)  # a fresh process per job: its RSS is that job's
        jobs = JobStore(db)
        load_node_settings = functools.partial(load_settings, **overrides)  # each node: its own ALLOY_DATA_DIR
        trees = {name: psutil.Process(node.process.pid) for name, node in nodes.items()}
        rows = []
        for label, parallelism, cold in (
            ("one process, cold", 1, True),
            (f"fan-out x{args.workers}, cold", args.workers, True),
            ("one process, warm", 1, False),
            (f"fan-out x{args.workers}, warm", args.workers, False),
            (f"fan-out x{args.workers}, warm workers", args.workers, False),  # the last run's worker processes
        ):
            if cold:
                for name in nodes:
                    shutil.rmtree(work / name / "data" / "cache", ignore_errors=True)
            output = f"out-{len(rows)}"
            request = MergeRequest(
                models=[f.name for f in folders[1:]],
                strategy="ties",
                base_model="base",
                parameters={"density": 0.5, "weight": 1.0},
                output_model_id=output,
                parallelism=parallelism,
            )
            job = jobs.create(JobKind.MERGE, request.model_dump(mode="json"))
            # The job's process: on a worker (one process merges there), on the head for a fan-out (it only waits).
            where = (
                {"num_cpus": 1} if parallelism == 1 else {"num_cpus": 0, "resources": {"node:__internal_head__": 0.01}}
            )
            with RssSampler(trees) as sampler:
                record, wall = ray.get(bench_job.options(**where).remote(load_node_settings, job.id))
            assert record["state"] == "COMPLETED", record
            merge = record["result"]["merge"]
            groups = merge.get("groups") or []
            overhead = wall - max(g["seconds"] for g in groups) if groups else None
            rows.append((label, wall, merge, sampler.peak, overhead, output))
        print(
            f"\n{'run':24s} {'wall s':>6s} {'fetch':>6s} {'merge':>6s} {'upload':>6s} {'start':>6s} {'publish':>7s}"
            f"  {'coordination':>12s}  peak RSS MB per node"
        )
        for label, wall, merge, peak, overhead, _ in rows:
            rss = " ".join(f"{name}={value / 1e6:.0f}" for name, value in peak.items())
            groups = merge.get("groups")
            if groups:  # the slowest group's phases; start = launching the tasks; publish = the coordinator's end
                slow = _slowest(merge)
                phases = (slow["fetch_s"], slow["merge_s"], slow["upload_s"])
                extra = (merge["groups_s"] - slow["seconds"], merge["publish_s"])
                cells = " ".join(f"{v:6.1f}" for v in phases) + f" {extra[0]:6.1f} {extra[1]:7.1f}  {overhead:12.1f}"
            else:  # one process: fetch, upload and publish are not split (wall - merge)
                cells = (
                    f"{wall - merge['seconds']:5.1f}* {merge['seconds']:6.1f} {'-':>6s} {'-':>6s} {'-':>7s}  {'-':>12s}"
                )
            print(f"{label:24s} {wall:6.1f} {cells}  {rss}")
        print("* one process: fetch + upload + publish + register together (wall - merge)")
        out_bytes = rows[0][2]["bytes"]
        for kind, one, fan in (
            ("cold", rows[0], rows[1]),
            ("warm", rows[2], rows[3]),
            ("warm workers", rows[2], rows[4]),
        ):
            print(
                f"speed-up ({kind}): one process / fan-out = {one[1] / fan[1]:.2f}x end to end, "
                f"{one[2]['seconds'] / _slowest(fan[2])['merge_s']:.2f}x on the merge itself"
            )
        same = [{(f.key.rsplit("/", 1)[1], f.sha256) for f in store.dir_manifest(f"models/{row[5]}")} for row in rows]
        print(f"outputs identical (sha256 of every published file, all runs): {all(s == same[0] for s in same)}")
        warm_one = rows[2]
        print(
            json.dumps(
                {
                    "model_mb": model_bytes / 1e6,
                    "inputs": len(folders),
                    "output_mb": out_bytes / 1e6,
                    "upload_mb_s": upload_bw / 1e6,
                    "publish_mb_s": publish_bw / 1e6,
                    "download_mb_s": download_bw / 1e6,
                    "node_throughput_mb_s": (len(folders) * model_bytes + out_bytes) / 1e6 / warm_one[2]["seconds"],
                    "runs": {
                        label: {"wall_s": wall, "overhead_s": overhead} for label, wall, _, _, overhead, _ in rows
                    },
                    "load": os.getloadavg(),
                    "total_s": time.perf_counter() - started,
                }
            )
        )
    finally:
        if ray.is_initialized():
            ray.shutdown()
        stop_cluster(head, nodes)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
