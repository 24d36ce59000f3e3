"""Typed request and response bodies of the HTTP API (they are the OpenAPI schema at /docs), shared by the
server (``serve_app``, which re-exports them as ``serve_app.schemas``) and the Python client (``alloy.client``).

Pure pydantic: nothing here imports FastAPI, Ray or Serve, so ``alloy.client`` can be used without a server.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from alloy.evaluation.results import EvalResult
from alloy.ids import MAX_PATH_LENGTH, NO_CONTROL_CHARACTERS, ResourceId, ShortText, SourcePath
from alloy.jobs.merge_request import EvaluateSpec, MergeRequest, SplitName  # noqa: F401 - re-exported
from alloy.jobs.records import JOB_ID_PATTERN, JobEvent, JobKind, JobRecord, JobState  # noqa: F401 - re-exported
from alloy.merge.dry_run import DryRunReport  # noqa: F401 - re-exported

T = TypeVar("T")

# -- bounded identifiers and values (paths, query strings and free-form JSON bodies) -------------------------
JobId = Annotated[str, StringConstraints(max_length=64, pattern=f"^{JOB_ID_PATTERN.pattern}$")]
# Experiment ids: a job id, an evaluation's uuid, or "evolution-<job id>".
ExperimentId = Annotated[str, StringConstraints(max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
KeyId = Annotated[str, StringConstraints(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
ArtifactKey = Annotated[str, StringConstraints(min_length=1, max_length=1024, pattern=NO_CONTROL_CHARACTERS)]
ArtifactPrefix = Annotated[str, StringConstraints(max_length=1024, pattern=NO_CONTROL_CHARACTERS)]
NodeId = Annotated[str, StringConstraints(max_length=64, pattern=r"^[0-9a-fA-F]+$")]
RateText = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9 /]+$")]
KeyOwner = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[\x20-\x7e]+$")]

# Free-form JSON a client stores (a model's lineage, a dataset's task): at most four levels deep, every string,
# list and object bounded, no control characters; what a database column and a log line can take.
MAX_JSON_ITEMS = 1024
MAX_JSON_KEYS = 64
_JsonKey = Annotated[str, StringConstraints(max_length=128, pattern=NO_CONTROL_CHARACTERS)]
_JsonText = Annotated[str, StringConstraints(max_length=MAX_PATH_LENGTH, pattern=NO_CONTROL_CHARACTERS)]
_JsonLeaf = (
    _JsonText
    | Annotated[int, Field(ge=-(2**53), le=2**53)]
    | Annotated[float, Field(allow_inf_nan=False)]
    | bool
    | None
)
_Json1 = (
    _JsonLeaf
    | Annotated[list[_JsonLeaf], Field(max_length=MAX_JSON_ITEMS)]
    | Annotated[dict[_JsonKey, _JsonLeaf], Field(max_length=MAX_JSON_KEYS)]
)
_Json2 = (
    _JsonLeaf
    | Annotated[list[_Json1], Field(max_length=MAX_JSON_ITEMS)]
    | Annotated[dict[_JsonKey, _Json1], Field(max_length=MAX_JSON_KEYS)]
)
_Json3 = (
    _JsonLeaf
    | Annotated[list[_Json2], Field(max_length=MAX_JSON_ITEMS)]
    | Annotated[dict[_JsonKey, _Json2], Field(max_length=MAX_JSON_KEYS)]
)
JsonObject = Annotated[dict[_JsonKey, _Json3], Field(max_length=MAX_JSON_KEYS)]


class PageOf(BaseModel, Generic[T]):
    items: list[T]
    total: int
    offset: int
    limit: int


class JobAccepted(BaseModel):
    """Answer of a job-creating POST (202): poll ``progress_url`` until a terminal state."""

    job_id: str
    progress_url: str = Field(description="Absolute URL of GET /jobs/{job_id}")
    status: Literal["CREATED"] = "CREATED"


class JobErrorView(BaseModel):
    code: str
    message: str


class JobView(BaseModel):
    """Progress of a job (GET /jobs/{job_id})."""

    job_id: str
    kind: JobKind
    state: JobState
    percent: float = Field(0.0, ge=0, le=100)
    stage: str | None = None
    tensors_done: int | None = None
    tensors_total: int | None = None
    bytes_done: int | None = None
    bytes_total: int | None = None
    bytes_per_s: float | None = None
    attempts: int = Field(0, description="How many times the job was interrupted and replayed")
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    model_id: str | None = Field(None, description="The merged model's ID (COMPLETED merges)")
    error: JobErrorView | None = Field(None, description="Set on FAILED")
    result: dict[str, Any] | None = None
    progress_url: str

    @classmethod
    def from_record(cls, job: JobRecord, progress_url: str) -> JobView:
        progress = job.progress or {}
        percent = 100.0 if job.state is JobState.COMPLETED else float(progress.get("percent") or 0.0)
        return cls(
            job_id=job.id,
            kind=job.kind,
            state=job.state,
            percent=min(max(percent, 0.0), 100.0),
            stage=progress.get("stage"),
            tensors_done=progress.get("tensors_done"),
            tensors_total=progress.get("tensors_total"),
            bytes_done=progress.get("bytes_done"),
            bytes_total=progress.get("bytes_total"),
            bytes_per_s=progress.get("bytes_per_s"),
            attempts=job.attempts,
            created_at=job.created_at,
            updated_at=job.updated_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            model_id=(job.result or {}).get("model_id") if job.state is JobState.COMPLETED else None,
            error=JobErrorView(**job.error.model_dump()) if job.error else None,
            result=job.result,
            progress_url=progress_url,
        )


class ModelRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: ResourceId
    source: SourcePath = Field(description="Local folder under a configured model root, or an artifact key/URI")
    lineage: JsonObject | None = None
    kind: Literal["model", "adapter"] | None = Field(
        None,
        description="model, or adapter (a PEFT LoRA adapter folder: adapter_config.json + adapter_model.safetensors, "
        "merged as 'base-id+adapter-id'); default: an adapter_config.json folder is an adapter",
    )


class ModelView(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    kind: Literal["model", "adapter"] = "model"
    architecture: str | None = None
    model_type: str | None = None
    parameter_count: int | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    size_bytes: int | None = None
    fingerprint: str | None = None
    artifact_prefix: str | None = None
    owner: str | None = None
    lineage: dict[str, Any] | None = None
    created_at: datetime | None = None
    broken: str | None = Field(
        None,
        description="Why the model's files cannot be used (damaged or missing; it names the file); null when "
        "they can. A broken model is refused as a merge or evaluation input until it is registered again.",
    )


class DatasetRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset_id: ResourceId
    source: SourcePath = Field(description="Local file/folder under a configured root, or an artifact key/URI")
    splits: Annotated[dict[SplitName, SourcePath], Field(max_length=16)] | None = Field(
        None, description="Split name -> file, instead of one source file"
    )
    task: JsonObject | None = Field(None, description="How the dataset is scored (docs/API.md, the task schema)")


class DatasetView(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    description: str | None = None
    task: dict[str, Any] | None = None
    splits: dict[str, Any] | None = None
    row_count: int | None = None
    artifact_prefix: str | None = None
    owner: str | None = None
    created_at: datetime | None = None


class ExperimentView(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    name: str | None = None
    kind: str | None = None
    params: dict[str, Any] | None = None
    owner: str | None = None
    created_at: datetime | None = None


class ArtifactView(BaseModel):
    model_config = ConfigDict(extra="allow")

    key: str
    uri: str | None = None
    size: int | None = None
    sha256: str | None = None
    download_url: str | None = None


class EvaluationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ResourceId] = Field(min_length=1, max_length=8)
    datasets: list[ResourceId] = Field(min_length=1, max_length=16)
    split: SplitName = "test"
    batch_size: int | None = Field(None, ge=1, le=1024)
    experiment_id: ExperimentId | None = Field(None, description="Record the results under this experiment")


class EvaluationResults(BaseModel):
    """What a COMPLETED evaluation job measured: one row per (model, dataset, metric)."""

    job_id: str
    experiment_id: str | None = None
    results: list[EvalResult]
    duration_s: float | None = None


class ComponentHealth(BaseModel):
    status: Literal["healthy", "unhealthy", "absent"]
    detail: dict[str, Any] | None = None


class HealthView(BaseModel):
    status: Literal["healthy", "degraded"]
    cluster_state: str
    config_version: int
    profile: str
    gpus: float
    nodes: list[dict[str, Any]]
    draining_nodes: list[str]
    components: dict[str, ComponentHealth]


class ReloadView(BaseModel):
    config_version: int


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_id: NodeId | None = Field(None, description="Ray node id (hex); default: the only worker node")
    reason: ShortText = "maintenance"
    deadline_s: int | None = Field(None, ge=0, le=7 * 24 * 3600)


class DrainView(BaseModel):
    node_id: str
    accepted: bool
    message: str | None = None


class FlushView(BaseModel):
    lsn: int = Field(description="Log sequence number after the flush")


class CacheClearView(BaseModel):
    caches: dict[str, dict[str, Any]]


class JobStreamEvent(BaseModel):
    """One Server-Sent Event of GET /jobs/{job_id}/events: ``state`` (a history row), ``progress`` (the latest
    progress snapshot) or ``end`` (the final job; the stream closes after it)."""

    event: Literal["state", "progress", "end"]
    id: str = Field(description="Send as Last-Event-ID to resume after this event")
    data: dict[str, Any]


class MethodParameterView(BaseModel):
    name: str
    type: str  # float | int | bool
    scope: Literal["global", "per_model", "input"]  # one value / one per model but the base / one per model
    default: float | int | bool | None
    required: bool
    minimum: float | None
    maximum: float | None
    description: str


class MethodView(BaseModel):
    """One merge method (mergekit's name), the strategy family it is a variant of, and its parameters."""

    name: str
    family: Literal["slerp", "ties", "dare", "task_arithmetic", "franken_merge"]
    description: str
    base: Literal["required", "optional", "ignored"]
    min_models: int
    max_models: int | None
    random: bool
    parameters: list[MethodParameterView]


class KeyCreate(BaseModel):
    """Body of POST /admin/keys."""

    model_config = ConfigDict(extra="forbid")

    owner: KeyOwner
    scopes: list[Literal["read", "write", "admin"]] = Field(min_length=1, max_length=3)
    read_limit: RateText | None = Field(None, description="e.g. 100/minute; default: rate_limits.read")
    jobs_limit: RateText | None = Field(None, description="e.g. 10/minute; default: rate_limits.jobs")
    expires_in_s: int | None = Field(
        None, gt=0, le=10 * 366 * 24 * 3600, description="Seconds until the key expires (at most ten years)"
    )


class KeyView(BaseModel):
    """An API key as listed: everything but its secret."""

    key_id: str
    owner: str
    scopes: list[str]
    read_limit: str | None = None
    jobs_limit: str | None = None
    created_at: datetime
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    rotated_from: str | None = None
    last_used_at: datetime | None = None
    status: Literal["active", "expired", "revoked"]


class NewKeyView(KeyView):
    key: str = Field(description="The secret: shown in this answer only, never again")
