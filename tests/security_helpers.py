"""A small FastAPI app wired with Alloy's error handlers and security, and real uvicorn servers for it.

``build_test_app(settings)`` has one route of each kind the middleware treats differently: a read, a job
creation (jobs bucket), a plain write, an admin route, a route with a validated body and ResourceId path, a
route that crashes, and a streaming upload. ``app_from_env`` is the uvicorn factory used when the app runs in
separate processes (two replicas sharing Redis): ``ALLOY_TEST_DB_URL`` and ``ALLOY_TEST_RATE_SETTINGS`` (JSON)
configure it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, Field

from alloy.config import Settings
from alloy.control.ports import pick_port_block
from alloy.errors import model_not_found
from alloy.ids import ResourceId
from alloy.storage.db import Database
from alloy.storage.keys import ApiKeyStore, Principal
from serve_app.errors import install_error_handlers
from serve_app.security import current_principal, install_security, require_scope

REPO_ROOT = Path(__file__).resolve().parents[1]


class MergeBody(BaseModel):
    models: list[ResourceId] = Field(min_length=2, max_length=8)
    strategy: str = Field(pattern="^(slerp|ties|dare|task_arithmetic|franken_merge)$")
    output_model: ResourceId


def build_test_app(settings: Settings, db_url: str) -> FastAPI:
    app = FastAPI(title="alloy-security-test")
    install_error_handlers(app)

    def key_store() -> ApiKeyStore:
        return ApiKeyStore(Database(db_url))

    install_security(app, key_store_factory=key_store, settings=settings)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/models/{model_id}")
    def get_model(model_id: ResourceId, principal: Principal = Depends(current_principal)) -> dict[str, str]:
        if model_id == "missing":
            raise model_not_found(model_id)
        return {"id": model_id, "owner": principal.owner}

    @app.post("/merge/execute", status_code=202)
    def merge(body: MergeBody) -> dict[str, Any]:
        return {"job_id": "job-1", "status": "CREATED", "models": body.models}

    @app.post("/notes")
    def write_note(body: dict[str, str]) -> dict[str, int]:
        return {"stored": len(body)}

    @app.post("/upload")
    async def upload(request: Request) -> dict[str, int]:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
        return {"size": size}

    @app.post("/admin/flush", dependencies=[Depends(require_scope("admin"))])
    def flush() -> dict[str, int]:
        return {"lsn": 1}

    @app.get("/crash", include_in_schema=False)
    def crash() -> None:
        raise RuntimeError("secret internal detail: /var/lib/alloy password=hunter2")

    return app


def make_settings(**rate_limits: str) -> Settings:
    return Settings(
        rate_limits={"read": "100/minute", "jobs": "10/minute", "anonymous": "10000/minute", **rate_limits},
        server={"max_body_bytes": 1024},
    )


def app_from_env() -> FastAPI:
    """uvicorn factory for subprocess replicas."""
    rate = json.loads(os.environ.get("ALLOY_TEST_RATE_SETTINGS", "{}"))
    return build_test_app(make_settings(**rate), os.environ["ALLOY_TEST_DB_URL"])


def free_port() -> int:
    """A free loopback port inside the project's range, clear of the ports this machine reserves."""
    return pick_port_block(1)[0]


def wait_until_up(base_url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(base_url + "/openapi.json", timeout=1.0)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    raise TimeoutError(f"{base_url} did not come up")


@contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with real uvicorn on loopback in this process; yield its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(base_url)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def serve_in_processes(count: int, env: dict[str, str]) -> Iterator[list[str]]:
    """``count`` separate uvicorn processes of :func:`app_from_env` (like ingress replicas); yield their URLs."""
    ports = [free_port() for _ in range(count)]
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "tests.security_helpers:app_from_env",
                "--factory",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            cwd=REPO_ROOT,
            env={**os.environ, **env},
        )
        for port in ports
    ]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url in urls:
            wait_until_up(url)
        yield urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
