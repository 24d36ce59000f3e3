"""The post-merge evaluation of a merge job (its EVALUATING state)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from alloy.evaluation.service import EvaluationService, result_summary
from alloy.storage.tracker import ExperimentTracker


def evaluate_model_dir(
    model_dir: str | Path,
    dataset_ids: list[str],
    split: str = "test",
    *,
    datasets,
    db=None,
    model_id: str | None = None,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Post-merge evaluation (a merge job's EVALUATING state): score a model folder on registered datasets.

    Results are logged to the ExperimentTracker when ``db`` is given. Returns the job-result summary
    ``{"experiment_id", "results": [EvalResult...], "metrics": {dataset_id: {metric: value}}, "duration_s"}``."""

    tracker = None
    if db is not None:
        tracker = ExperimentTracker(db)
    service = EvaluationService(None, datasets, tracker, None, getattr(datasets, "store", None), cache_capacity=0)
    started = time.perf_counter()
    name = model_id or Path(model_dir).name
    results = service.evaluate_dir(model_dir, dataset_ids, split, batch_size=batch_size, model_id=name)
    summary = result_summary(results, None, time.perf_counter() - started)
    summary["experiment_id"] = service.last_experiment_id
    summary["metrics"] = {r.dataset_id: {r.metric: r.value} for r in results}
    return summary
