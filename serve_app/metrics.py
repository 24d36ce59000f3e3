"""Prometheus metrics of the HTTP API (GET /metrics).

Request counts and latency are observed by an ASGI middleware in this process. Job figures come from the
database at scrape time (jobs by state, queue depth = CREATED jobs, merge throughput = the sum of the running
merges' bytes/s), so they are right whichever replica ran the jobs. Cache hit rates are asked of the engines.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401 - re-exported for the route
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from alloy.cluster.state import state_metric_values
from alloy.jobs.records import JobState


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "alloy_http_requests_total", "HTTP requests", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "alloy_http_request_duration_seconds",
            "HTTP request latency",
            ["method", "route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.jobs = Gauge("alloy_jobs", "Jobs by kind and state", ["kind", "state"], registry=self.registry)
        self.queue_depth = Gauge(
            "alloy_job_queue_depth", "Jobs waiting to start (CREATED)", ["kind"], registry=self.registry
        )
        self.merge_bytes_per_s = Gauge(
            "alloy_merge_bytes_per_second", "Sum of running merges' throughput", registry=self.registry
        )
        self.cache_hit_rate = Gauge(
            "alloy_model_cache_hit_rate", "Model cache hit rate since last clear", ["component"], registry=self.registry
        )
        self.cache_hits = Gauge(
            "alloy_model_cache_hits", "Model cache hits since last clear", ["component"], registry=self.registry
        )
        self.cache_misses = Gauge(
            "alloy_model_cache_misses", "Model cache misses since last clear", ["component"], registry=self.registry
        )
        self.config_version = Gauge("alloy_config_version", "Live configuration version", registry=self.registry)
        self.cluster_state = Gauge(
            "alloy_cluster_state",
            "1 for the current cluster lifecycle state, 0 for others",
            ["state"],
            registry=self.registry,
        )
        self.lifecycle_step_seconds = Gauge(
            "alloy_lifecycle_step_seconds",
            "Duration of each step of the last start and the last stop",
            ["phase", "step"],
            registry=self.registry,
        )

    def observe_jobs(self, counts: dict[tuple[str, str], int], running_bytes_per_s: float) -> None:
        for (kind, state), count in counts.items():
            self.jobs.labels(kind=kind, state=state).set(count)
            if state == JobState.CREATED.value:
                self.queue_depth.labels(kind=kind).set(count)
        self.merge_bytes_per_s.set(running_bytes_per_s)

    def observe_cache(self, component: str, stats: dict[str, Any]) -> None:
        self.cache_hit_rate.labels(component=component).set(stats.get("hit_rate", 0.0))
        self.cache_hits.labels(component=component).set(stats.get("hits", 0))
        self.cache_misses.labels(component=component).set(stats.get("misses", 0))

    def observe_cluster(self, status: Any) -> None:
        """The persisted cluster status (alloy.cluster.state.ClusterStatus): the one-hot state gauge and the
        step durations of the last start and stop."""
        for name, value in state_metric_values(status.state).items():
            self.cluster_state.labels(state=name).set(value)
        for phase, run in (("start", status.last_start), ("stop", status.last_stop)):
            for step in run.steps if run is not None else []:
                self.lifecycle_step_seconds.labels(phase=phase, step=step.name).set(step.duration_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts and times every HTTP request by route template (``/jobs/{job_id}``, not the concrete path, so the
    label set stays bounded)."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def send_and_record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "GET")
            self.metrics.requests.labels(method=method, route=template, status=str(status["code"])).inc()
            self.metrics.latency.labels(method=method, route=template).observe(time.perf_counter() - started)
