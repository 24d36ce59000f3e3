"""The wire models of evolutions: progress, candidates, the Pareto front of a multi-objective search, and the
promotion of a front member (shared by the HTTP routes and the typed client)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alloy.ids import MAX_PATH_LENGTH, ResourceId
from alloy.jobs.records import JobState
from alloy.wire import JobErrorView, ModelView


class ParetoMember(BaseModel):
    """One member of a multi-objective evolution's Pareto front (search.kind nsga2), scored on the whole dev
    split: no other candidate is at least as good on every fitness dataset and better on one."""

    candidate_id: str = Field(description="the candidate (trial row) to name in POST /evolutions/{job_id}/promote")
    generation: int
    fitness: float = Field(description="mean dev score over the datasets (signed: higher is better)")
    scores: dict[str, float] = Field(description="dev score per fitness dataset (the dataset's own metric)")
    genome: dict[str, float]
    recipe: dict[str, Any]


class PromoteRequest(BaseModel):
    """POST /evolutions/{job_id}/promote: register one Pareto front member as a model."""

    model_config = ConfigDict(extra="forbid")

    candidate_id: str = Field(min_length=1, max_length=MAX_PATH_LENGTH, description="a member of pareto_front")
    model_id: ResourceId = Field(description="the id to register the merged member under")


class PromotionView(BaseModel):
    """The registered front member and its one test score."""

    job_id: str
    candidate_id: str
    model: ModelView
    test: dict[str, Any] = Field(description="metric, mean and per_dataset scores on the evolution's test split")


class EvolutionView(BaseModel):
    """Progress of an evolution (GET /evolutions/{job_id})."""

    model_config = ConfigDict(extra="allow")

    job_id: str
    state: JobState
    progress_url: str
    generation: int = 0
    generations: int | None = None
    population: int | None = None
    best_fitness: float | None = None
    median_fitness: float | None = None
    trials: int = 0
    percent: float = 0.0
    cancel_requested: bool = False
    attempts: int = 0
    result: dict[str, Any] | None = None
    error: JobErrorView | None = None
    pareto_front: list[ParetoMember] | None = Field(
        None,
        description="search.kind nsga2, once COMPLETED: the non-dominated candidates by per-dataset dev score, best "
        "mean first; any member can be registered with POST /evolutions/{job_id}/promote",
    )


class TrialsView(BaseModel):
    """Every evaluated candidate of an evolution (GET /evolutions/{job_id}/trials)."""

    job_id: str
    state: JobState
    count: int
    trials: list[dict[str, Any]]
