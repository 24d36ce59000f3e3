"""Evaluation engine: perplexity, log-likelihood classification / multiple choice for causal LMs, and
prototype classification for sentence encoders; the EvaluationService and the CandidateEvaluator fast path.

Names are imported lazily so that ``import alloy.evaluation`` (which ``alloy.wire``, hence the client and the
CLI, reach for ``EvalResult``) does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EvalResult": "alloy.evaluation.results",
    "EvaluationService": "alloy.evaluation.service",
    "EvaluationRequest": "alloy.evaluation.service",
    "CandidateEvaluator": "alloy.evaluation.candidate",
    "LocalDatasets": "alloy.evaluation.dataset_sources",
    "RegistryDatasets": "alloy.evaluation.dataset_sources",
    "load_model": "alloy.evaluation.loading",
    "parse_task": "alloy.evaluation.tasks",
    "evaluate_model_dir": "alloy.evaluation.post_merge",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
