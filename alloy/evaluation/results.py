"""The record of one evaluation: one metric of one model on one dataset split."""

from __future__ import annotations

from pydantic import BaseModel


class EvalResult(BaseModel):
    model_id: str
    dataset_id: str
    split: str
    metric: str
    value: float
    n: int
    duration_s: float
