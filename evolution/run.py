"""Batch evolution on a running cluster:

    ray job submit --address http://127.0.0.1:<dashboard port> --working-dir . -- \
        python -m evolution.run configs/evolve-tiny.yaml

The driver joins the cluster (``ray.init(address="auto")``), creates an evolution job in the same JobStore the API
uses (settings from ``configs/alloy.yaml`` / ``ALLOY_*``: same database and artifact store), and runs it with the
same engine, so the job, its trials, the registered model and the fitness plot appear through the API; the Tune
trials appear in the Ray dashboard under this job. ``--job-id`` resumes an interrupted job (Tuner.restore); a job
whose owner is still alive (it wrote within ``--stale-after-s``) is refused with exit status 2, never run twice.
"""

from __future__ import annotations

import argparse
import json
import sys

import ray

from alloy.config import load_settings
from alloy.jobs.liveness import silent_for_s
from alloy.jobs.records import JobKind, JobState
from evolution.config import load_spec_file
from evolution.engine import EvolutionService


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evolution.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="configs/evolve-<preset>.yaml")
    parser.add_argument("--job-id", help="resume this evolution job instead of creating one")
    parser.add_argument("--owner", default="ray-job-submit")
    parser.add_argument("--address", default="auto", help="Ray address (default: the cluster this job runs on)")
    parser.add_argument(
        "--stale-after-s",
        type=float,
        default=120.0,
        help="--job-id: take over a running job only after its owner has been silent this long",
    )
    args = parser.parse_args(argv)

    spec = load_spec_file(args.config)
    service = EvolutionService.from_settings(load_settings())
    service.db.verify_schema()
    if args.job_id:
        job_id = args.job_id
        job = service.jobs.get(job_id)
        if not job.state.terminal and job.state is not JobState.CREATED:
            silent = silent_for_s(job)
            if silent < args.stale_after_s:  # its owner (a replica or another driver) is alive: never run it twice
                print(
                    f"evolution {job_id} is {job.state.value} and its owner wrote {silent:.0f}s ago; "
                    f"resume it once it has been silent for {args.stale_after_s:.0f}s",
                    file=sys.stderr,
                )
                return 2
            service.jobs.requeue(job_id, "resumed by python -m evolution.run")
    if not ray.is_initialized():
        ray.init(address=args.address)
    if not args.job_id:
        job_id = service.jobs.create(JobKind.EVOLUTION, spec.model_dump(mode="json"), args.owner).id
    print(f"evolution job {job_id}: progress at GET /evolutions/{job_id}", flush=True)
    result = service.run_job(job_id)
    record = service.jobs.get(job_id)
    print(
        json.dumps(
            {
                "job_id": job_id,
                "state": record.state.value,
                "error": record.error.model_dump() if record.error else None,
                "model_id": result.get("model_id"),
                "test": (result.get("test") or {}).get("scores"),
                "fitness_plot": result.get("fitness_plot"),
            },
            indent=2,
            default=str,
        ),
        flush=True,
    )
    return 0 if record.state.value == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
