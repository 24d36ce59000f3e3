"""The asynchronous client: ``AsyncClient`` and ``AsyncJob``, the same calls as :mod:`alloy.client.sync` with
``await`` (for notebooks and services that already run an event loop)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
from httpx_sse import aconnect_sse

from alloy.client import _common as c
from alloy.client.errors import AlloyAPIError
from alloy.wire import (
    EvaluationResults,
    JobStreamEvent,
    JobView,
    ModelView,
    PageOf,
)
from alloy.wire_evolution import EvolutionView, ParetoMember, PromoteRequest, PromotionView, TrialsView


class AsyncJob:
    def __init__(self, client: AsyncClient, job_id: str):
        self.client = client
        self.id = job_id
        self.view: JobView | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    async def refresh(self) -> JobView:
        self.view = JobView.model_validate(await self.client._get(f"/jobs/{self.id}"))
        return self.view

    async def events(self, last_event_id: str | None = None) -> AsyncIterator[JobStreamEvent]:
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        async with aconnect_sse(
            self.client.http,
            "GET",
            f"/jobs/{self.id}/events",
            headers=headers,
            timeout=httpx.Timeout(self.client.http.timeout.connect, read=None),
        ) as source:
            if source.response.status_code >= 400:
                await source.response.aread()
                c.check(source.response)
            async for sse in source.aiter_sse():
                yield c.stream_event(sse)

    async def wait(self) -> JobView:
        """Follow the events until the job ends (resuming a dropped stream) and return the final view."""
        last: str | None = None
        while True:
            try:
                async for event in self.events(last):
                    last = event.id
                    if event.event == "end":
                        return await self.refresh()
            except (httpx.TransportError, httpx.StreamError):
                continue
            view = await self.refresh()
            if view.state.value in c.TERMINAL_STATES:
                return view


class AsyncEvolution(AsyncJob):
    async def status(self) -> EvolutionView:
        return EvolutionView.model_validate(await self.client._get(f"/evolutions/{self.id}"))

    async def trials(self, generation: int | None = None) -> list[dict[str, Any]]:
        params = {"generation": generation} if generation is not None else {}
        body = await self.client._get(f"/evolutions/{self.id}/trials", params=params)
        return TrialsView.model_validate(body).trials

    async def best(self) -> dict[str, Any] | None:
        return c.best_trial(await self.trials())

    async def pareto_front(self) -> list[ParetoMember]:
        return (await self.status()).pareto_front or []

    async def promote(self, candidate_id: str, model_id: str, timeout: float = c.PROMOTE_TIMEOUT_S) -> PromotionView:
        body = PromoteRequest(candidate_id=candidate_id, model_id=model_id).model_dump()
        response = await self.client._request("POST", f"/evolutions/{self.id}/promote", json=body, timeout=timeout)
        return PromotionView.model_validate(response.json())


class AsyncClient:
    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = c.DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = c.resolve_url(base_url)
        self.http = httpx.AsyncClient(
            base_url=self.base_url, headers=c.auth_headers(c.resolve_key(api_key)), timeout=timeout, transport=transport
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return c.check(await self.http.request(method, path, **kwargs))
        except httpx.TransportError as exc:
            raise AlloyAPIError.unreachable(self.base_url, exc) from None

    async def _get(self, path: str, **kwargs: Any) -> Any:
        return (await self._request("GET", path, **kwargs)).json()

    async def merge(self, models: list[str], strategy: str, output_model_id: str, **fields: Any) -> AsyncJob:
        """Same keywords as :meth:`alloy.client.Client.merge`."""
        body = c.merge_body(models, strategy, output_model_id, **fields)
        return AsyncJob(self, (await self._request("POST", "/merge/execute", json=body)).json()["job_id"])

    async def job(self, job_id: str) -> AsyncJob:
        job = AsyncJob(self, job_id)
        await job.refresh()
        return job

    async def jobs(
        self, *, state: str | None = None, kind: str | None = None, offset: int = 0, limit: int = 50
    ) -> PageOf[JobView]:
        params = {
            k: v for k, v in {"state": state, "kind": kind, "offset": offset, "limit": limit}.items() if v is not None
        }
        return PageOf[JobView].model_validate(await self._get("/jobs", params=params))

    async def evaluate(self, models: list[str], datasets: list[str], split: str = "test") -> AsyncJob:
        body = {"models": models, "datasets": datasets, "split": split}
        return AsyncJob(self, (await self._request("POST", "/evaluations", json=body)).json()["job_id"])

    async def evaluation_results(self, job_id: str) -> EvaluationResults:
        return EvaluationResults.model_validate(await self._get(f"/evaluations/{job_id}/results"))

    async def evolve(self, spec: dict[str, Any]) -> AsyncEvolution:
        return AsyncEvolution(self, (await self._request("POST", "/evolutions", json=spec)).json()["job_id"])

    async def model(self, model_id: str) -> ModelView:
        return ModelView.model_validate(await self._get(f"/models/{model_id}"))

    async def models(self, offset: int = 0, limit: int = 50) -> PageOf[ModelView]:
        return PageOf[ModelView].model_validate(await self._get("/models", params={"offset": offset, "limit": limit}))
