"""Typed Python client of the Alloy HTTP API (httpx), built on the server's own wire models (:mod:`alloy.wire`).

``Client`` / ``AsyncClient`` read ``ALLOY_URL`` and ``ALLOY_API_KEY`` when not given a URL or key. Every failure
is an :class:`AlloyAPIError` with the service's error ``code``, the HTTP ``status`` and the ``message``.
Importing this package never imports FastAPI, Ray or Serve (nor starts anything).
"""

from alloy.client.aio import AsyncClient, AsyncEvolution, AsyncJob
from alloy.client.errors import AlloyAPIError
from alloy.client.sync import Client, Evolution, Job

__all__ = ["AlloyAPIError", "AsyncClient", "AsyncEvolution", "AsyncJob", "Client", "Evolution", "Job"]
