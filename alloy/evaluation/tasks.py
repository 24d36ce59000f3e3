"""The evaluation task a dataset carries: the free-form ``task`` dict stored with it, parsed and checked.

Three kinds (schema with examples in docs/API.md, "Evaluation"):

* ``perplexity``: causal LM perplexity over a text column.
* ``classification``: a text column and an integer label column. ``head: "prototypes"`` scores sentence
  encoders against stored class prototypes; ``head: "loglik"`` scores causal LMs by the log-likelihood of each
  class's label text after a prompt.
* ``multiple_choice``: causal LM picks the most likely of per-row choices.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, model_validator

from alloy.errors import from_validation_error, validation_failed


class PerplexityTask(BaseModel):
    type: Literal["perplexity"]
    text_field: str = "text"
    max_length: int = Field(256, ge=2)

    @property
    def metric(self) -> str:
        return "perplexity"


class ClassificationTask(BaseModel):
    type: Literal["classification"]
    text_field: str = "text"
    label_field: str = "label"
    labels: list[str] = Field(min_length=2)
    label_texts: list[str] | None = None  # what a class is called in prompts/embeddings; default: labels
    head: Literal["prototypes", "loglik"] = "prototypes"
    # The prototype head: one of an artifact key, an absolute local path, or a file inside a local dataset folder.
    head_artifact: str | None = None
    head_path: str | None = None
    head_file: str | None = None
    scale: float = Field(25.0, gt=0)
    max_length: int = Field(128, ge=2)
    # loglik head: the prompt and the continuation scored for each class.
    prompt_template: str = "{text}\nAnswer:"
    choice_template: str = " {choice}"
    model_kind: str | None = None  # informative only

    @model_validator(mode="after")
    def _consistent(self) -> ClassificationTask:
        if self.label_texts is not None and len(self.label_texts) != len(self.labels):
            raise ValueError("label_texts must have one entry per label")
        if self.head == "prototypes" and not (self.head_artifact or self.head_path or self.head_file):
            raise ValueError("a prototypes head needs head_artifact, head_path or head_file")
        return self

    @property
    def choices(self) -> list[str]:
        return self.label_texts or self.labels

    @property
    def metric(self) -> str:
        return "accuracy"


class MultipleChoiceTask(BaseModel):
    type: Literal["multiple_choice"]
    prompt_field: str = "prompt"
    choices_field: str = "choices"
    label_field: str = "label"
    max_length: int = Field(256, ge=2)
    choice_template: str = " {choice}"
    normalize: Literal["sum", "mean"] = "sum"  # sum or per-token mean of the choice's log-likelihood

    @property
    def metric(self) -> str:
        return "accuracy"


TaskSpec = Annotated[PerplexityTask | ClassificationTask | MultipleChoiceTask, Field(discriminator="type")]
_ADAPTER: TypeAdapter = TypeAdapter(TaskSpec)


def parse_task(
    task: dict[str, Any] | None, dataset_id: str = ""
) -> PerplexityTask | ClassificationTask | MultipleChoiceTask:
    if not task:
        raise validation_failed(f"dataset {dataset_id!r} has no evaluation task", dataset_id=dataset_id)
    try:
        return _ADAPTER.validate_python(task)
    except ValidationError as exc:
        raise from_validation_error(exc, f"dataset {dataset_id!r} has an invalid task", dataset_id=dataset_id) from None


def higher_is_better(metric: str) -> bool:
    return metric != "perplexity"
