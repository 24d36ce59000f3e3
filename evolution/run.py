"""Batch evolution on a running cluster:

    ray job submit --address http://127.0.0.1:<dashboard port> --working-dir . -- \
        python -m evolution.run configs/evolve-tiny.yaml

The driver joins the cluster (``ray.init(address="auto")``), creates an evolution job in the same JobStore the API
uses (settings from ``configs/alloy.yaml`` / ``ALLOY_*``: same database and artifact store), and runs it with the
same engine, so the job, its trials, the registered model and the fitness plot appear through the API; the Tune
trials appear in the Ray dashboard under this job. ``--job-id`` resumes an interrupted job (Tuner.restore).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evolution.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="configs/evolve-<preset>.yaml")
    parser.add_argument("--job-id", help="resume this evolution job instead of creating one")
    parser.add_argument("--owner", default="ray-job-submit")
    parser.add_argument("--address", default="auto", help="Ray address (default: the cluster this job runs on)")
    args = parser.parse_args(argv)

    import ray

    from alloy.config import load_settings
    from alloy.jobs import JobKind
    from evolution.config import load_spec_file
    from evolution.engine import EvolutionService

    spec = load_spec_file(args.config)
    if not ray.is_initialized():
        ray.init(address=args.address)
    service = EvolutionService.from_settings(load_settings())
    service.db.verify_schema()
    if args.job_id:
        job_id = args.job_id
        if service.jobs.get(job_id).state.value not in ("CREATED", "COMPLETED", "FAILED"):
            service.jobs.requeue(job_id, "resumed by python -m evolution.run")
    else:
        job_id = service.jobs.create(JobKind.EVOLUTION, spec.model_dump(mode="json"), args.owner).id
    print(f"evolution job {job_id}: progress at GET /evolutions/{job_id}", flush=True)
    result = service.run_job(job_id)
    record = service.jobs.get(job_id)
    print(json.dumps({"job_id": job_id, "state": record.state.value,
                      "error": record.error.model_dump() if record.error else None,
                      "model_id": result.get("model_id"), "test": (result.get("test") or {}).get("scores"),
                      "fitness_plot": result.get("fitness_plot")}, indent=2, default=str), flush=True)
    return 0 if record.state.value == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
