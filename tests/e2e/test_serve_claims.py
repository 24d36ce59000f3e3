"""Atomic claims over real HTTP through the Serve proxy (two ingress replicas): of concurrent submissions for one
output id exactly one is accepted and the rest get 409 ALREADY_EXISTS; a FAILED merge frees its output id; no
submission is accepted once DRAINING begins."""

from __future__ import annotations

import re
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.ray

RACERS = 6
ROUNDS = 20
GATE_TTL_S = 1.1  # the ingress caches the cluster state for 1 s (its fast pre-check)
LEAKS = re.compile(r"(/tmp/|/work/|/var/|\.py\b|Traceback|SELECT |INSERT |UPDATE |sqlite|psycopg|IntegrityError)")


def slerp(output: str, models: tuple[str, str] = ("tune1", "tune2")) -> dict:
    return {"models": list(models), "strategy": "slerp", "parameters": {"t": 0.5}, "output_model_id": output}


def test_concurrent_same_output_merges_accept_exactly_one(alloy_service, served_models):
    """20 rounds of 6 concurrent POST /merge/execute for one output id: one 202, five 409 ALREADY_EXISTS, none
    with internals in its message; every accepted merge completes and registers its id."""
    clients = [alloy_service.client("write", timeout=60.0) for _ in range(RACERS)]
    accepted: dict[str, str] = {}
    with ThreadPoolExecutor(RACERS) as pool:
        for round_ in range(ROUNDS):
            output = f"race-{round_}-{uuid.uuid4().hex[:6]}"
            start = threading.Barrier(RACERS)

            def submit(client: httpx.Client, output: str = output, start: threading.Barrier = start) -> httpx.Response:
                start.wait()
                return client.post("/merge/execute", json=slerp(output))

            answers = list(pool.map(submit, clients))
            statuses = sorted(answer.status_code for answer in answers)
            assert statuses == [202] + [409] * (RACERS - 1), [(a.status_code, a.text[:200]) for a in answers]
            for answer in answers:
                if answer.status_code == 409:
                    error = answer.json()["error"]
                    assert error["code"] == "ALREADY_EXISTS" and error["details"]["model_id"] == output
                    assert not LEAKS.search(answer.text), answer.text
                else:
                    accepted[output] = answer.json()["progress_url"]
    for output, url in accepted.items():
        job = alloy_service.wait_job(url)
        assert job["state"] == "COMPLETED" and job["model_id"] == output, job


def test_a_failed_merge_frees_its_output_id(alloy_service, served_models, tiny_model_factory):
    alloy_service.register_model("claim-fragile", tiny_model_factory("llama", seed=41, base=served_models["base"]))
    stored = alloy_service.data_dir / "artifacts" / "models" / "claim-fragile"
    for weights in stored.glob("*.safetensors"):  # the merge validates (manifests) and then cannot read them
        weights.unlink()
    client = alloy_service.client("write")
    doomed = client.post("/merge/execute", json=slerp("claim-freed", ("tune1", "claim-fragile")))
    assert doomed.status_code == 202, doomed.text
    failed = alloy_service.wait_job(doomed.json()["progress_url"])
    assert failed["state"] == "FAILED", failed
    assert not LEAKS.search(failed["error"]["message"]), failed["error"]

    again = client.post("/merge/execute", json=slerp("claim-freed"))
    assert again.status_code == 202, again.text
    assert alloy_service.wait_job(again.json()["progress_url"])["state"] == "COMPLETED"
    assert client.post("/merge/execute", json=slerp("claim-freed")).status_code == 409  # now registered
    shutil.rmtree(stored, ignore_errors=True)


def test_no_submission_is_accepted_once_draining_begins(alloy_service, served_models):
    """Submissions from three clients while the cluster moves to DRAINING: every request sent after the move
    committed is refused with 503 (the ingress's 1 s cache of the state is not what decides), and every job
    accepted before it completes."""
    from alloy.cluster.state import ClusterState, ClusterStateStore
    from alloy.storage.db import Database

    db = Database(alloy_service.database_url)
    store = ClusterStateStore(db)
    answers: list[tuple[float, int, dict]] = []
    stop = threading.Event()

    def submit_until_stopped() -> None:
        client = alloy_service.client("write")
        while not stop.is_set():
            sent = time.monotonic()
            answer = client.post("/merge/execute", json=slerp(f"drain-{uuid.uuid4().hex[:8]}"))
            answers.append((sent, answer.status_code, answer.json()))

    threads = [threading.Thread(target=submit_until_stopped, daemon=True) for _ in range(3)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        store.transition(ClusterState.DRAINING)
        drained_at = time.monotonic()
        time.sleep(2 * GATE_TTL_S)
        stop.set()
        for thread in threads:
            thread.join(60)
    finally:
        stop.set()
        if store.state() is not ClusterState.STARTING:
            store.begin_start("warm")
        store.mark_ready()
        time.sleep(GATE_TTL_S)
    after = [(status, body) for sent, status, body in answers if sent >= drained_at]
    assert after and all(status == 503 for status, _ in after), after
    assert all(body["error"]["details"]["cluster_state"] == "DRAINING" for _, body in after)
    accepted = [body for _, status, body in answers if status == 202]
    assert accepted and {status for _, status, _ in answers} <= {202, 503}
    for body in accepted:
        assert alloy_service.wait_job(body["progress_url"])["state"] == "COMPLETED"
    db.close()


def test_registering_an_id_an_active_merge_claims_is_409(alloy_service, served_models):
    from alloy.errors import ErrorCode
    from alloy.jobs.merge_admission import create_merge_job
    from alloy.jobs.merge_request import MergeRequest
    from alloy.jobs.store import JobStore
    from alloy.storage.db import Database

    db = Database(alloy_service.database_url)
    jobs = JobStore(db)
    claim = create_merge_job(jobs, MergeRequest(**slerp("claimed-output")))  # written, never dispatched
    try:
        response = alloy_service.client("write").post(
            "/models", json={"model_id": "claimed-output", "source": str(served_models["tune3"])}
        )
        assert response.status_code == 409, response.text
        assert response.json()["error"]["details"]["job_id"] == claim.id
    finally:
        jobs.fail(claim.id, ErrorCode.CANCELLED, "test claim released")
        db.close()
    alloy_service.register_model("claimed-output", served_models["tune3"])  # free again
