"""What every deployment is built from: the application's typed args, and the plain services they open.

A deployment's constructor receives ``AppArgs`` as a plain dict (what ``.bind()`` can serialize) and turns it
into :class:`alloy.config.Settings` with :meth:`AppArgs.load_settings`. ``config_path`` is applied by setting
``ALLOY_CONFIG`` in the replica's own process, so the usual sources (YAML, ``ALLOY_*`` env, Vault) keep their
precedence; ``settings`` overrides sit on top of them (init arguments win).
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from alloy.components import APP_NAME
from alloy.config import Settings, load_settings
from alloy.jobs.liveness import DEFAULT_LEASE_S, DEFAULT_SWEEP_S
from alloy.jobs.store import JobStore
from alloy.registry.datasets import DatasetRegistry
from alloy.registry.models import ModelRegistry
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.db import Database
from alloy.storage.tracker import ExperimentTracker


class AppArgs(BaseModel):
    """Typed arguments of the application builder (``args:`` in ``configs/serve.yaml``)."""

    config_path: str | None = Field(
        None, description="Alloy YAML config file (default: ALLOY_CONFIG or configs/alloy.yaml)"
    )
    profile: Literal["cpu", "gpu"] | None = Field(None, description="Overrides the config's profile")
    public_url: str | None = Field(None, description="Base of absolute URLs (default: the request's base URL)")
    settings: dict[str, Any] = Field(default_factory=dict, description="Overrides of alloy Settings fields")
    app_name: str = Field(APP_NAME, description="Serve application name (for handles looked up at runtime)")
    gpu_on_demand: bool = Field(
        False, description="GPU profile on an autoscaling cluster: accept jobs while no GPU node is up yet"
    )
    job_stale_after_s: float = Field(
        DEFAULT_LEASE_S,
        gt=0,
        description="The job lease: a running job whose owner wrote nothing (heartbeat) for this long is lost; "
        "an engine replica's sweeper then requeues it and dispatches it again",
    )
    job_sweep_interval_s: float = Field(
        DEFAULT_SWEEP_S, gt=0, description="How often each engine replica looks for lost jobs of its kind"
    )

    def load_settings(self) -> Settings:
        if self.config_path:
            os.environ["ALLOY_CONFIG"] = str(Path(self.config_path).expanduser())
        overrides = dict(self.settings)
        if self.profile:
            overrides["profile"] = self.profile
        if self.public_url:
            overrides.setdefault("server", {})
            overrides["server"] = {**overrides["server"], "public_url": self.public_url}
        return load_settings(**overrides)


class Services:
    """The plain services of one process, opened lazily from settings (each deployment opens what it uses)."""

    def __init__(self, settings: Settings):
        self.settings = settings

    @cached_property
    def db(self):
        db = Database.from_settings(self.settings)
        db.verify_schema()  # cold start step 3: refuse an old or newer schema with a clear message
        return db

    @cached_property
    def store(self):
        return ArtifactStore(self.settings.artifacts_uri, self.settings.storage_options)

    @cached_property
    def jobs(self):
        return JobStore(self.db)

    @cached_property
    def models(self):
        return ModelRegistry.from_settings(self.settings, self.db, self.store)

    @cached_property
    def datasets(self):
        roots = [Path(root) for root in self.settings.model_roots] + [Path(self.settings.data_dir)]
        return DatasetRegistry(self.db, self.store, roots=roots)

    @cached_property
    def tracker(self):
        return ExperimentTracker(self.db)

    def close(self) -> None:
        if "db" in self.__dict__:
            self.db.close()


def open_services(args: dict[str, Any] | AppArgs) -> tuple[AppArgs, Services]:
    app_args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    return app_args, Services(app_args.load_settings())
