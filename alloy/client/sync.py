"""The synchronous client: ``Client`` and the ``Job`` / ``Evolution`` handles it returns.

from alloy.client import Client
with Client() as alloy:                      # ALLOY_URL and ALLOY_API_KEY from the environment
    job = alloy.merge(["a", "b"], "ties", "a-b", base_model="base", parameters={"density": 0.5})
    view = job.wait(progress=True)           # follows the job's live events
    alloy.download_model(view.model_id, "out/")
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import connect_sse

from alloy.client import _common as c
from alloy.client.errors import AlloyAPIError
from alloy.client.progress import ProgressDisplay
from alloy.wire import (
    ArtifactView,
    DatasetView,
    EvaluationResults,
    JobEvent,
    JobStreamEvent,
    JobView,
    KeyView,
    ModelView,
    NewKeyView,
    PageOf,
)
from alloy.wire_evolution import EvolutionView, ParetoMember, PromoteRequest, PromotionView, TrialsView

DOWNLOAD_CHUNK = 1 << 20


class Job:
    """A submitted job. ``view`` is the last state fetched; :meth:`refresh` fetches it again."""

    def __init__(self, client: Client, job_id: str):
        self.client = client
        self.id = job_id
        self.view: JobView | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def refresh(self) -> JobView:
        self.view = JobView.model_validate(self.client._get(f"/jobs/{self.id}"))
        return self.view

    def history(self) -> list[JobEvent]:
        return [JobEvent.model_validate(e) for e in self.client._get(f"/jobs/{self.id}/events")]

    def events(self, last_event_id: str | None = None) -> Iterator[JobStreamEvent]:
        """The job's live events (Server-Sent Events) until it ends; resumes after ``last_event_id``."""
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        # No read timeout: a stream is quiet between events (the server pings every 15 s).
        with connect_sse(
            self.client.http,
            "GET",
            f"/jobs/{self.id}/events",
            headers=headers,
            timeout=httpx.Timeout(self.client.http.timeout.connect, read=None),
        ) as source:
            if source.response.status_code >= 400:
                source.response.read()
                c.check(source.response)
            for sse in source.iter_sse():
                yield c.stream_event(sse)

    def wait(self, progress: bool = False, timeout_s: float | None = None) -> JobView:
        """Follow the events until the job ends and return its final view. A dropped connection is resumed
        from the last event seen. ``progress=True`` draws a one-line progress bar on the terminal."""
        display = ProgressDisplay(self.id, enabled=progress)
        last: str | None = None
        with display:
            while True:
                try:
                    for event in self.events(last):
                        last = event.id
                        display.update(event)
                        if event.event == "end":
                            return self.refresh()
                except (httpx.TransportError, httpx.StreamError):
                    continue  # reconnect with Last-Event-ID
                # The stream closed without an end event (an ingress replica went away): check, then resume.
                view = self.refresh()
                if view.state.value in c.TERMINAL_STATES:
                    return view

    @property
    def model_id(self) -> str | None:
        return (self.view or self.refresh()).model_id


class Evolution(Job):
    def status(self) -> EvolutionView:
        return EvolutionView.model_validate(self.client._get(f"/evolutions/{self.id}"))

    def trials(self, generation: int | None = None) -> list[dict[str, Any]]:
        params = {"generation": generation} if generation is not None else {}
        return TrialsView.model_validate(self.client._get(f"/evolutions/{self.id}/trials", params=params)).trials

    def best(self) -> dict[str, Any] | None:
        """The trial with the highest fitness so far (None before the first one is scored)."""
        return c.best_trial(self.trials())

    def cancel(self) -> EvolutionView:
        return EvolutionView.model_validate(self.client._request("POST", f"/evolutions/{self.id}/cancel").json())

    def pareto_front(self) -> list[ParetoMember]:
        """The Pareto front of a completed multi-objective (nsga2) evolution; empty otherwise."""
        return self.status().pareto_front or []

    def promote(self, candidate_id: str, model_id: str, timeout: float = c.PROMOTE_TIMEOUT_S) -> PromotionView:
        """Register the front member ``candidate_id`` as ``model_id`` (merged, registered, tested once)."""
        body = PromoteRequest(candidate_id=candidate_id, model_id=model_id).model_dump()
        response = self.client._request("POST", f"/evolutions/{self.id}/promote", json=body, timeout=timeout)
        return PromotionView.model_validate(response.json())


class Client:
    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = c.DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ):
        self.base_url = c.resolve_url(base_url)
        self.http = httpx.Client(
            base_url=self.base_url, headers=c.auth_headers(c.resolve_key(api_key)), timeout=timeout, transport=transport
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # -- plumbing ---------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return c.check(self.http.request(method, path, **kwargs))
        except httpx.TransportError as exc:
            raise AlloyAPIError.unreachable(self.base_url, exc) from None

    def _get(self, path: str, **kwargs: Any) -> Any:
        return self._request("GET", path, **kwargs).json()

    # -- jobs -------------------------------------------------------------------------------------------------
    def merge(
        self,
        models: list[str],
        strategy: str,
        output_model_id: str,
        *,
        variant: str | None = None,
        base_model: str | None = None,
        parameters: dict[str, Any] | None = None,
        model_parameters: dict[str, dict[str, Any]] | None = None,
        slices: list[dict[str, Any]] | None = None,
        dtype: str | None = None,
        seed: int | None = None,
        evaluate: dict[str, Any] | None = None,
    ) -> Job:
        body = c.merge_body(
            models,
            strategy,
            output_model_id,
            variant=variant,
            base_model=base_model,
            parameters=parameters,
            model_parameters=model_parameters,
            slices=slices,
            dtype=dtype,
            seed=seed,
            evaluate=evaluate,
        )
        return self.submit_merge(body)

    def submit_merge(self, body: dict[str, Any]) -> Job:
        """POST a ready MergeRequest body (what ``alloy submit merge --recipe`` builds)."""
        return Job(self, self._request("POST", "/merge/execute", json=body).json()["job_id"])

    def job(self, job_id: str) -> Job:
        job = Job(self, job_id)
        job.refresh()
        return job

    def jobs(
        self, *, state: str | None = None, kind: str | None = None, offset: int = 0, limit: int = 50
    ) -> PageOf[JobView]:
        params = {
            k: v for k, v in {"state": state, "kind": kind, "offset": offset, "limit": limit}.items() if v is not None
        }
        return PageOf[JobView].model_validate(self._get("/jobs", params=params))

    def evaluate(self, models: list[str], datasets: list[str], split: str = "test") -> Job:
        body = {"models": models, "datasets": datasets, "split": split}
        return Job(self, self._request("POST", "/evaluations", json=body).json()["job_id"])

    def evaluation_results(self, job_id: str) -> EvaluationResults:
        return EvaluationResults.model_validate(self._get(f"/evaluations/{job_id}/results"))

    def evolve(self, spec: dict[str, Any]) -> Evolution:
        """Start an evolution; ``spec`` is the POST /evolutions body (see configs/evolve-*.yaml)."""
        return Evolution(self, self._request("POST", "/evolutions", json=spec).json()["job_id"])

    def evolution(self, job_id: str) -> Evolution:
        evolution = Evolution(self, job_id)
        evolution.status()  # NOT_FOUND now rather than later
        return evolution

    # -- models, datasets, artifacts --------------------------------------------------------------------------
    def register_model(self, model_id: str, source: str, lineage: dict[str, Any] | None = None) -> ModelView:
        body = {"model_id": model_id, "source": source, **({"lineage": lineage} if lineage else {})}
        return ModelView.model_validate(self._request("POST", "/models", json=body).json())

    def model(self, model_id: str) -> ModelView:
        return ModelView.model_validate(self._get(f"/models/{model_id}"))

    def models(self, offset: int = 0, limit: int = 50) -> PageOf[ModelView]:
        return PageOf[ModelView].model_validate(self._get("/models", params={"offset": offset, "limit": limit}))

    def delete_model(self, model_id: str) -> None:
        self._request("DELETE", f"/models/{model_id}")

    def register_dataset(
        self, dataset_id: str, source: str, *, splits: dict[str, Any] | None = None, task: dict[str, Any] | None = None
    ) -> DatasetView:
        body = {"dataset_id": dataset_id, "source": source, "splits": splits, "task": task}
        return DatasetView.model_validate(
            self._request("POST", "/datasets", json={k: v for k, v in body.items() if v is not None}).json()
        )

    def dataset(self, dataset_id: str) -> DatasetView:
        return DatasetView.model_validate(self._get(f"/datasets/{dataset_id}"))

    def datasets(self, offset: int = 0, limit: int = 50) -> PageOf[DatasetView]:
        return PageOf[DatasetView].model_validate(self._get("/datasets", params={"offset": offset, "limit": limit}))

    def delete_dataset(self, dataset_id: str) -> None:
        self._request("DELETE", f"/datasets/{dataset_id}")

    def artifacts(self, prefix: str = "") -> list[ArtifactView]:
        return [ArtifactView.model_validate(a) for a in self._get("/artifacts", params={"prefix": prefix})]

    def download(self, key: str, dest: str | Path) -> Path:
        """Download one artifact to ``dest`` (a file path). A partial file left by an interrupted download is
        continued with an HTTP Range request instead of starting over."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        size = ArtifactView.model_validate(self._get(f"/artifacts/{key}")).size
        have = dest.stat().st_size if dest.exists() else 0
        if size is not None and have == size:
            return dest
        have = have if size is not None and have < size else 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            with self.http.stream("GET", f"/artifacts/{key}/content", headers=headers) as response:
                if response.status_code >= 400:
                    response.read()
                    c.check(response)
                start = c.resumed_offset(response, have)
                with open(dest, "r+b" if start else "wb") as out:
                    out.seek(start)
                    out.truncate()
                    for chunk in response.iter_bytes(DOWNLOAD_CHUNK):
                        out.write(chunk)
        except httpx.TransportError as exc:
            raise AlloyAPIError.unreachable(self.base_url, exc) from None
        return dest

    def download_model(self, model_id: str, dest_dir: str | Path) -> list[Path]:
        """Every file of a registered model into ``dest_dir`` (resuming partial files)."""
        prefix = self.model(model_id).artifact_prefix or f"models/{model_id}"
        return [
            self.download(a.key, Path(dest_dir) / a.key.rsplit("/", 1)[-1])
            for a in self.artifacts(prefix.rstrip("/") + "/")
        ]

    # -- API keys (admin scope) ------------------------------------------------------------------------------
    def keys(self) -> list[KeyView]:
        return [KeyView.model_validate(k) for k in self._get("/admin/keys")]

    def create_key(
        self,
        owner: str,
        scopes: list[str],
        *,
        read_limit: str | None = None,
        jobs_limit: str | None = None,
        expires_in_s: int | None = None,
    ) -> NewKeyView:
        """A new key; its secret (``.key``) is in this answer only."""
        body = {
            "owner": owner,
            "scopes": scopes,
            "read_limit": read_limit,
            "jobs_limit": jobs_limit,
            "expires_in_s": expires_in_s,
        }
        return NewKeyView.model_validate(
            self._request("POST", "/admin/keys", json={k: v for k, v in body.items() if v is not None}).json()
        )

    def revoke_key(self, key_id: str) -> KeyView:
        return KeyView.model_validate(self._request("DELETE", f"/admin/keys/{key_id}").json())

    def health(self) -> dict[str, Any]:
        return self._get("/health")
