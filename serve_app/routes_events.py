"""``GET /jobs/{job_id}/events``: a job's history as JSON, or, with ``Accept: text/event-stream``, its live
events as Server-Sent Events until the job ends (see :mod:`alloy.job_stream` for what is sent and how
``Last-Event-ID`` resumes).

One stream is one HTTP request: the security middleware authenticates and rate-limits it once when it opens,
however long it lasts. The stream polls the JobStore (the one place every engine replica writes to), so it works
the same whichever ingress replica serves it and whichever engine replica runs the job.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Header, Request
from sse_starlette.sse import EventSourceResponse, ServerSentEvent

from alloy.job_stream import JobFollower, follow
from alloy.jobs.records import JobEvent
from alloy.wire import JobId, JobView
from serve_app.context import api_context
from serve_app.errors import error_responses
from serve_app.security import require_scope

router = APIRouter(tags=["jobs"])

EVENT_STREAM = "text/event-stream"
POLL_INTERVAL_S = 0.25
# The ids this stream sends ("<history id>" or "<history id>.<n>"), at most 18 digits each: a database integer.
LAST_EVENT_ID_PATTERN = r"^[0-9]{1,18}(\.[0-9]{1,18})?$"
PING_INTERVAL_S = 15  # keeps proxies from closing an idle stream (a long evolution generation)

_STREAM_DOC = (
    "Server-Sent Events. `event: state` (id = history id) for every state change, `event: progress` "
    "(id = `<history id>.<n>`) with the latest progress (tensors/bytes for merges; generation, best and median "
    "fitness for evolutions), then one `event: end` with the final job (as GET /jobs/{job_id}); the stream "
    "closes after it. "
    "Send `Last-Event-ID` to resume after the last event seen."
)


def _wants_stream(accept: str | None) -> bool:
    return EVENT_STREAM in (accept or "")


async def _events(request: Request, follower: JobFollower) -> AsyncIterator[ServerSentEvent]:
    while True:
        for item in await asyncio.to_thread(follower.poll):
            yield ServerSentEvent(data=json.dumps(item.data), event=item.event, id=item.id)
        if follower.finished or await request.is_disconnected():
            return
        await asyncio.sleep(POLL_INTERVAL_S)


@router.get(
    "/jobs/{job_id}/events",
    dependencies=[Depends(require_scope("read"))],
    response_model=list[JobEvent],
    summary="History of a job, or its live events (Accept: text/event-stream)",
    responses={
        200: {
            "description": "The history (JSON), or the live event stream (text/event-stream)",
            "content": {EVENT_STREAM: {"schema": {"type": "string", "description": _STREAM_DOC}}},
        },
        **error_responses(401, 403, 404, 429, 503),
    },
)
async def job_events(
    job_id: JobId,
    request: Request,
    accept: str | None = Header(None, include_in_schema=False),
    last_event_id: str | None = Header(
        None,
        max_length=37,
        pattern=LAST_EVENT_ID_PATTERN,
        description="Resume a stream after this event id (an id this stream sent: N or N.M)",
    ),
) -> Any:
    ctx = api_context(request)
    jobs = ctx.services.jobs
    if not _wants_stream(accept):
        return await asyncio.to_thread(jobs.events, job_id)
    url = ctx.url_for_job(request, job_id)
    follower = await asyncio.to_thread(  # NOT_FOUND before the stream opens
        follow, jobs, job_id, last_event_id, end_view=lambda job: JobView.from_record(job, url).model_dump(mode="json")
    )
    # X-Accel-Buffering keeps nginx-style proxies from buffering.
    return EventSourceResponse(
        _events(request, follower),
        ping=PING_INTERVAL_S,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
