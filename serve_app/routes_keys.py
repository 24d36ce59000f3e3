"""``/admin/keys``: list, create and revoke API keys over HTTP (admin scope, like every /admin route), the same
store and rules as ``alloy key create|list|revoke``. A new key's secret is in the creation answer only."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from fastapi import APIRouter, Depends, Request

from alloy.storage.db.types import utcnow
from alloy.storage.keys import ApiKeyStore, describe
from alloy.wire import KeyCreate, KeyId, KeyView, NewKeyView
from serve_app.context import api_context
from serve_app.security import require_scope

router = APIRouter(prefix="/admin/keys", tags=["admin"], dependencies=[Depends(require_scope("admin"))])


def _store(request: Request) -> ApiKeyStore:
    return ApiKeyStore(api_context(request).services.db)


@router.get("", response_model=list[KeyView], summary="Every API key (without secrets)")
async def list_keys(request: Request) -> list[KeyView]:
    records = await asyncio.to_thread(_store(request).list)
    return [KeyView.model_validate(describe(record)) for record in records]


@router.post("", status_code=201, response_model=NewKeyView, summary="Create an API key (its secret is shown once)")
async def create_key(body: KeyCreate, request: Request) -> NewKeyView:
    expires_at = utcnow() + timedelta(seconds=body.expires_in_s) if body.expires_in_s else None
    record, secret = await asyncio.to_thread(
        _store(request).create,
        body.owner,
        body.scopes,
        read_limit=body.read_limit,
        jobs_limit=body.jobs_limit,
        expires_at=expires_at,
    )
    return NewKeyView.model_validate({**describe(record), "key": secret})


@router.delete("/{key_id}", response_model=KeyView, summary="Revoke an API key at once")
async def revoke_key(key_id: KeyId, request: Request) -> KeyView:
    return KeyView.model_validate(describe(await asyncio.to_thread(_store(request).revoke, key_id)))
