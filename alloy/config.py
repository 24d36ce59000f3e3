"""Typed configuration: ``configs/alloy.yaml`` (or ``ALLOY_CONFIG``), ``ALLOY_*`` environment overrides and an
optional HashiCorp Vault KV v2 source.

Precedence, highest first: init arguments, environment (``ALLOY_DATABASE__URL`` sets ``database.url``), Vault
(when ``vault.enabled``), the YAML file, the defaults below. The defaults are the embedded profile: SQLite and a
local artifact folder under ``./var``.

:class:`ConfigHolder` owns the live settings and their version, which increments on every successful reload; a
reload that fails validation leaves the old settings (and version) in place.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from alloy.errors import AlloyError, ErrorCode, from_validation_error
from alloy.http_port import DEFAULT_HTTP_PORT

DEFAULT_CONFIG_PATH = Path("configs/alloy.yaml")


class DatabaseSettings(BaseModel):
    url: str | None = Field(None, description="SQLAlchemy URL; default sqlite:///<data_dir>/alloy.db")
    echo: bool = False


class S3Settings(BaseModel):
    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None


class ArtifactSettings(BaseModel):
    uri: str | None = Field(None, description="Local folder or s3://bucket/prefix; default <data_dir>/artifacts")
    s3: S3Settings = S3Settings()
    chunk_bytes: int = Field(8 * 1024 * 1024, gt=0)


class RateLimitSettings(BaseModel):
    read: str = Field("100/minute", description="limits-library notation, per API key")
    jobs: str = Field("10/minute", description="merge and evolution job creation, per API key")
    storage_uri: str = Field("memory://", description="memory:// (one ingress replica) or redis://host:port")
    key_prefix: str = Field("alloy-rl", description="prefix of the rate-limit keys in shared storage (Redis)")
    anonymous: str = Field(
        "100/minute", description="requests without a valid API key, per client IP (throttles key guessing)"
    )


class AuthSettings(BaseModel):
    # SecretStr: never shown by repr() or in logs of the settings; read it with .get_secret_value().
    admin_key: SecretStr | None = Field(None, description="Bootstrap admin key; generated and shown once when unset")
    rotation_grace_seconds: int = Field(3600, ge=0)


class ServerSettings(BaseModel):
    public_url: str | None = Field(None, description="Base of absolute URLs; default: the request's base URL")
    max_body_bytes: int = Field(1024 * 1024, gt=0)
    port: int = Field(
        DEFAULT_HTTP_PORT, ge=1, le=65535, description="HTTP port of `alloy start` (when free; --port overrides)"
    )


class MergeSettings(BaseModel):
    device: str = "cpu"
    shard_bytes: int = Field(2 * 1024**3, gt=0)
    max_in_flight: int = Field(4, ge=1, le=64)
    cache_bytes: int = Field(2 * 1024**3, ge=0)
    threads: int = Field(1, ge=1, description="torch threads per MergeEngine replica (and per fan-out group)")
    fanout_threshold_bytes: int | None = Field(
        32 * 1024**3,
        gt=0,
        description="a merge whose output is at least this large is fanned out: groups of output shards run as Ray "
        "tasks on any node (null: only when the request asks for `parallelism`)",
    )
    fanout_groups: int = Field(4, ge=2, le=256, description="groups of a merge fanned out by the size threshold")


class EvaluationSettings(BaseModel):
    batch_size: int = Field(32, ge=1, le=1024, description="examples per forward pass")
    cache_models: int = Field(2, ge=0, description="loaded models kept per evaluation replica (LRU)")
    threads: int = Field(1, ge=1, description="torch CPU threads per evaluation replica")


class LifecycleSettings(BaseModel):
    shutdown_timeout_s: float = Field(300.0, ge=0)
    warm_skip_dependency_checks: bool = False


class VaultSettings(BaseModel):
    enabled: bool = False
    url: str = "http://127.0.0.1:8200"
    token: str | None = None
    mount_point: str = "secret"
    path: str = "alloy"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ALLOY_", env_nested_delimiter="__", extra="forbid")

    profile: Literal["cpu", "gpu"] = "cpu"
    data_dir: Path = Path("var")
    model_roots: list[Path] = Field(default_factory=list, description="Folders local model paths may come from")
    message_queue_url: str | None = None
    database: DatabaseSettings = DatabaseSettings()
    artifacts: ArtifactSettings = ArtifactSettings()
    auth: AuthSettings = AuthSettings()
    rate_limits: RateLimitSettings = RateLimitSettings()
    server: ServerSettings = ServerSettings()
    merge: MergeSettings = MergeSettings()
    lifecycle: LifecycleSettings = LifecycleSettings()
    evaluation: EvaluationSettings = EvaluationSettings()
    vault: VaultSettings = VaultSettings()

    @field_validator("model_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [p for p in value.split(os.pathsep) if p]
        return value

    # Derived locations, so callers never rebuild them by hand.
    @property
    def database_url(self) -> str:
        return self.database.url or f"sqlite:///{(self.data_dir / 'alloy.db').resolve()}"

    @property
    def artifacts_uri(self) -> str:
        return self.artifacts.uri or str((self.data_dir / "artifacts").resolve())

    @property
    def merge_work_dir(self) -> Path:
        """Where MergeEngine replicas write merge outputs before registering them (partial outputs live here)."""
        return (self.data_dir / "work" / "merges").resolve()

    @property
    def evolution_dir(self) -> Path:
        """Tune experiments (checkpoints for resume), finalist merges and fitness plots of evolution jobs."""
        return (self.data_dir / "evolutions").resolve()

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec options for an s3:// artifact URI."""
        s3 = self.artifacts.s3
        options: dict[str, Any] = {}
        if s3.endpoint_url:
            options["client_kwargs"] = {
                "endpoint_url": s3.endpoint_url,
                **({"region_name": s3.region} if s3.region else {}),
            }
        if s3.access_key_id:
            options["key"] = s3.access_key_id
            options["secret"] = s3.secret_access_key
        return options

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, VaultSource(settings_cls), YamlFileSource(settings_cls))


PROJECT_ROOT = Path(__file__).resolve().parent.parent


def config_path() -> Path:
    """``ALLOY_CONFIG``; else ``configs/alloy.yaml`` in the current folder; else the project's own (so the CLI
    reads the same file from any folder, as the Serve builder does)."""
    if "ALLOY_CONFIG" in os.environ:
        return Path(os.environ["ALLOY_CONFIG"])
    if DEFAULT_CONFIG_PATH.exists():
        return DEFAULT_CONFIG_PATH
    return PROJECT_ROOT / DEFAULT_CONFIG_PATH


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with path.open() as handle:
        data = yaml.safe_load(handle) or {}
    if not isinstance(data, dict):
        raise AlloyError(ErrorCode.VALIDATION_FAILED, f"{path}: the top level must be a mapping")
    return data


class YamlFileSource(PydanticBaseSettingsSource):
    """The YAML file named by ``ALLOY_CONFIG`` (default ``configs/alloy.yaml``); absent means no values."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover - unused
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return _read_yaml(config_path())


class VaultSource(PydanticBaseSettingsSource):
    """HashiCorp Vault KV v2, read only when ``vault.enabled`` is set by a lower-precedence-free source
    (environment or YAML), because the Vault address itself cannot come from Vault."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover - unused
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        bootstrap = _vault_bootstrap()
        if not bootstrap.enabled:
            return {}
        import hvac  # imported lazily: only Vault users pay for it

        client = hvac.Client(url=bootstrap.url, token=bootstrap.token or os.environ.get("VAULT_TOKEN"))
        secret = client.secrets.kv.v2.read_secret_version(
            path=bootstrap.path, mount_point=bootstrap.mount_point, raise_on_deleted_version=True
        )
        data = secret["data"]["data"]
        if not isinstance(data, dict):
            raise AlloyError(ErrorCode.VALIDATION_FAILED, "vault secret must hold a mapping")
        data.pop("vault", None)  # Vault cannot re-point itself
        return data


def _vault_bootstrap() -> VaultSettings:
    raw = dict(_read_yaml(config_path()).get("vault") or {})
    for key in VaultSettings.model_fields:
        env = os.environ.get(f"ALLOY_VAULT__{key.upper()}")
        if env is not None:
            raw[key] = env
    return VaultSettings.model_validate(raw)


def load_settings(**overrides: Any) -> Settings:
    """Build settings from every source; an invalid value raises VALIDATION_FAILED naming the field."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise from_validation_error(exc, "invalid configuration") from None


class ConfigHolder:
    """The live settings plus a version that increments on each successful reload.

    ``loader`` is what a reload calls (default :func:`load_settings`); the app and ``alloy start`` pass their own
    so that the builder's ``settings`` overrides (data dir, database URL) survive a reload and only the file,
    environment and Vault sources are re-read."""

    def __init__(
        self, settings: Settings | None = None, version: int = 1, loader: Callable[[], Settings] = load_settings
    ):
        self._loader = loader
        self._settings = settings or loader()
        self._version = version
        self._lock = threading.Lock()

    @property
    def settings(self) -> Settings:
        return self._settings

    @property
    def version(self) -> int:
        return self._version

    def reload(self) -> int:
        """Re-read every source; keep the old settings if the new ones are invalid (the error propagates)."""
        fresh = self._loader()
        with self._lock:
            self._settings = fresh
            self._version += 1
            return self._version
