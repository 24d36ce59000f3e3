"""Progress-poll latency and throughput: through the Ray Serve proxy vs the same handler in plain FastAPI/uvicorn.

One run starts a local Ray head (free ports, token auth), deploys the app from configs/serve.yaml on a fresh SQLite
database, creates one job, then polls GET /jobs/{id} with the same concurrency against both servers and prints
p50/p99 latency, throughput and the Serve/plain ratio. The plain app is ``serve_app.api.create_api`` (same routes,
same security middleware, same JobStore read) served by uvicorn in this process.

    python -m bench.http_bench --requests 600 --concurrency 8 --rounds 3

The two servers are polled alternately, ``--rounds`` times each (a shared machine's load drifts: a ratio is only
fair between measurements taken side by side); the table gives the medians over the rounds and every round's
p50 ratio. ``tests/e2e/test_http_bench_smoke.py`` runs it with a few requests as a smoke test (no timing).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def poll(url: str, key: str, requests: int, concurrency: int) -> dict[str, float]:
    import httpx

    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=30) as client:
        for _ in range(min(20, requests)):  # warm-up: connections, caches, JIT-free but lazy imports
            (await client.get(url)).raise_for_status()
        queue = iter(range(requests))

        async def worker():
            for _ in queue:
                started = time.perf_counter()
                response = await client.get(url)
                latencies.append(time.perf_counter() - started)
                response.raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * percentile(latencies, 0.99),
        "rps": requests / elapsed,
    }


def start_plain_uvicorn(settings, port: int):
    import uvicorn

    from alloy.config import ConfigHolder
    from deployments.runtime import Services
    from serve_app.api import create_api
    from serve_app.context import ApiContext

    app = create_api(ApiContext(config=ConfigHolder(settings), services=Services(settings)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="alternate plain and Serve this many times")
    args = parser.parse_args()

    import ray

    from alloy.cluster.state import ClusterStateStore
    from alloy.config import load_settings
    from alloy.control.ports import pick_port_block
    from alloy.control.ray_head import start_ray_head, stop_ray_head
    from alloy.control.serve_deploy import deploy_serve_config, load_serve_config, wait_http_ready
    from alloy.jobs.records import JobKind
    from alloy.jobs.store import JobStore
    from alloy.storage.db import Database
    from alloy.storage.keys import ApiKeyStore

    data_dir = Path(tempfile.mkdtemp(prefix="alloy-bench-"))
    settings = load_settings(data_dir=str(data_dir))
    db = Database.from_settings(settings)
    db.upgrade()
    _, key = ApiKeyStore(db).create("bench", ["read"], read_limit="10000000/minute")
    # The Serve app gates every route on the cluster lifecycle (503 before READY); the bench deploys the app
    # directly, not through `alloy start`, so it walks the state row to READY itself, as the start sequence does.
    state = ClusterStateStore(db)
    state.begin_start("cold")
    state.mark_ready()
    job = JobStore(db).create(JobKind.MERGE, {"models": ["a", "b"], "strategy": "ties", "output_model_id": "c"})
    db.close()

    ray_dir = Path(tempfile.mkdtemp(prefix="alb", dir="/tmp"))  # short: Ray's unix socket paths
    head = start_ray_head(ray_dir, num_cpus=8)
    server = None
    try:
        head.apply_env()
        ray.init(address=head.address, log_to_driver=False)
        config = load_serve_config(
            ROOT / "configs" / "serve.yaml",
            app_args={"settings": {"data_dir": str(data_dir)}},
            http_port=head.http_port,
        )
        deploy_serve_config(config, timeout_s=600)
        serve_url = f"http://127.0.0.1:{head.http_port}/jobs/{job.id}"
        wait_http_ready(serve_url, timeout_s=120)

        plain_port = pick_port_block(1)[0]
        server, _ = start_plain_uvicorn(settings, plain_port)
        plain_url = f"http://127.0.0.1:{plain_port}/jobs/{job.id}"

        # Alternate the two servers round by round: a shared machine's load drifts, and a ratio is only fair
        # between measurements taken side by side. Each round's ratio is kept; the median is the figure.
        rounds: list[dict[str, dict[str, float]]] = []
        for _ in range(args.rounds):
            rounds.append(
                {
                    name: asyncio.run(poll(url, key, args.requests, args.concurrency))
                    for name, url in (("plain uvicorn", plain_url), ("ray serve proxy", serve_url))
                }
            )
        results = {
            name: {m: statistics.median(r[name][m] for r in rounds) for m in ("p50_ms", "p99_ms", "rps")}
            for name in rounds[0]
        }
        ratios = [r["ray serve proxy"]["p50_ms"] / r["plain uvicorn"]["p50_ms"] for r in rounds]

        print(
            f"\nGET /jobs/{{id}}: {args.requests} requests x {args.rounds} rounds, concurrency {args.concurrency}; "
            f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (medians over the rounds)"
        )
        print(f"{'server':<18}{'p50 ms':>10}{'p99 ms':>10}{'req/s':>10}")
        for name, r in results.items():
            print(f"{name:<18}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['rps']:>10.1f}")
        serve, plain = results["ray serve proxy"], results["plain uvicorn"]
        print(
            f"ratio serve/plain: p50 x{serve['p50_ms'] / plain['p50_ms']:.2f}, "
            f"p99 x{serve['p99_ms'] / plain['p99_ms']:.2f}, throughput x{serve['rps'] / plain['rps']:.2f}; "
            f"p50 ratio per round: {', '.join(f'x{r:.2f}' for r in ratios)}"
        )
    finally:
        if server is not None:
            server.should_exit = True
        ray.shutdown()
        stop_ray_head(head)
        shutil.rmtree(ray_dir, ignore_errors=True)
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
