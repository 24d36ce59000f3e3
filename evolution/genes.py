"""A gene: one bounded real value of a genome, and its interval (shared by the parameter-space genome,
:mod:`evolution.genome`, and the data-flow genome, :mod:`evolution.dataflow`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Bounds(BaseModel):
    """A closed interval for one parameter, with an optional starting value for the seed individual."""

    model_config = ConfigDict(extra="forbid")

    low: float = Field(allow_inf_nan=False)
    high: float = Field(allow_inf_nan=False)
    init: float | None = Field(None, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _from_pair(cls, value: Any) -> Any:
        # YAML shorthand: `density: [0.1, 1.0]` or `[0.1, 1.0, 0.5]` (low, high, init).
        if isinstance(value, (list, tuple)):
            if len(value) not in (2, 3):
                raise ValueError("bounds are [low, high] or [low, high, init]")
            return {"low": value[0], "high": value[1], **({"init": value[2]} if len(value) == 3 else {})}
        return value

    @model_validator(mode="after")
    def _ordered(self) -> Bounds:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.init is not None and not self.low <= self.init <= self.high:
            raise ValueError(f"init ({self.init}) lies outside [{self.low}, {self.high}]")
        return self

    @property
    def start(self) -> float:
        return self.init if self.init is not None else (self.low + self.high) / 2

    def clip(self, value: float) -> float:
        return min(max(value, self.low), self.high)


class GeneSpec(BaseModel):
    """One gene: its name, its bounds and, for decoding, where it goes in the recipe."""

    name: str
    bounds: Bounds
    parameter: str
    model_index: int | None = None  # None: a global recipe parameter
    group: int | None = None  # None: one value for every layer
    choices: list[str] | None = None  # a choice gene: the value floors to an index into these
