"""The merge slice over real HTTP through the Serve proxy of a real Ray cluster: POST /merge/execute answers 202
at once, a MergeEngine replica runs the job, the progress URL reaches COMPLETED and the output downloads and
loads; every synchronous error path; a merge survives the ingress replica being killed; two merges at once; a
FAILED merge leaves nothing registered."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray


@pytest.fixture(scope="session")
def big_models(alloy_service, tiny_model_factory):
    """Big enough (~70 MB each) that a merge takes seconds, so things can happen while it runs."""
    size = {"layers": 8, "hidden": 384, "vocab": 8192}
    base = tiny_model_factory("llama", seed=20, **size)
    for index, seed in enumerate((21, 22)):
        alloy_service.register_model(f"big{index + 1}", tiny_model_factory("llama", seed=seed, base=base, **size))
    alloy_service.register_model("bigbase", base)
    return ["big1", "big2"]


def merge_body(output: str, **changes):
    return {
        "models": ["tune1", "tune2"],
        "strategy": "ties",
        "base_model": "base",
        "parameters": {"density": 0.5},
        "output_model_id": output,
        **changes,
    }


def test_merge_returns_202_at_once_and_completes_with_a_loadable_model(alloy_service, served_models, tmp_path):
    client = alloy_service.client("write")
    started = time.monotonic()
    response = client.post("/merge/execute", json=merge_body("http-merged"))
    assert response.status_code == 202, response.text
    assert time.monotonic() - started < 10
    body = response.json()
    assert body["status"] == "CREATED" and body["job_id"]
    assert body["progress_url"] == f"{alloy_service.base_url}/jobs/{body['job_id']}"
    assert response.headers["Location"] == body["progress_url"]

    job = alloy_service.wait_job(body["progress_url"])
    assert job["state"] == "COMPLETED", job
    assert job["model_id"] == "http-merged" and job["percent"] == 100.0
    assert job["tensors_done"] == job["tensors_total"] > 0
    assert job["started_at"] and job["finished_at"]

    reader = alloy_service.client("read")
    model = reader.get("/models/http-merged").json()
    assert model["lineage"]["job_id"] == body["job_id"]
    artifacts = reader.get("/artifacts", params={"prefix": "models/http-merged"}).json()
    assert any(a["key"].endswith(".safetensors") for a in artifacts)
    out = tmp_path / "downloaded"
    out.mkdir()
    for artifact in artifacts:
        with reader.stream("GET", artifact["download_url"]) as download:
            assert download.status_code == 200
            with open(out / Path(artifact["key"]).name, "wb") as handle:
                for chunk in download.iter_bytes():
                    handle.write(chunk)
        assert (out / Path(artifact["key"]).name).stat().st_size == artifact["size"]

    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert sum(p.numel() for p in loaded.parameters()) == model["parameter_count"]

    listed = reader.get("/jobs", params={"state": "COMPLETED"}).json()
    assert body["job_id"] in [j["job_id"] for j in listed["items"]]


@pytest.mark.parametrize(
    "changes, status, code",
    [
        ({"strategy": "blend"}, 422, "INVALID_STRATEGY"),
        ({"models": ["tune1"]}, 422, "VALIDATION_FAILED"),
        ({"models": [f"m{i}" for i in range(9)]}, 422, "VALIDATION_FAILED"),
        ({"parameters": {"density": 3}}, 422, "VALIDATION_FAILED"),
        ({"parameters": {"bogus": 1}}, 422, "VALIDATION_FAILED"),
        ({"models": ["tune1", "ghost"]}, 404, "MODEL_NOT_FOUND"),
        ({"models": ["tune1", "gpt"]}, 422, "INCOMPATIBLE_MODELS"),
        ({"output_model_id": "tune3"}, 409, "ALREADY_EXISTS"),
        ({"output_model_id": "bad id!"}, 422, "VALIDATION_FAILED"),
        ({"evaluate": {"datasets": ["no-such-dataset"]}}, 404, "NOT_FOUND"),
    ],
)
def test_merge_request_errors_are_synchronous_and_structured(alloy_service, served_models, changes, status, code):
    before = alloy_service.client("read").get("/jobs", params={"limit": 1}).json()["total"]
    response = alloy_service.client("write").post("/merge/execute", json=merge_body("never-made", **changes))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["request_id"]
    assert alloy_service.client("read").get("/jobs", params={"limit": 1}).json()["total"] == before  # no job


def test_unknown_job_read_only_key_and_admin_scope(alloy_service, served_models):
    assert alloy_service.client("read").get("/jobs/nope").json()["error"]["code"] == "NOT_FOUND"
    response = alloy_service.client("read").post("/merge/execute", json=merge_body("x"))
    assert response.status_code == 403 and response.json()["error"]["code"] == "FORBIDDEN"
    assert alloy_service.client("write").delete("/admin/cache").status_code == 403


def _replica_actors(deployment: str) -> list:
    import ray
    from ray.util.state import list_actors

    actors = [
        ray.get_actor(actor.name, namespace=actor.ray_namespace or "serve")
        for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
        if actor.class_name.endswith(f":{deployment}") or actor.class_name.endswith(f"#{deployment}")
    ]
    assert actors, f"no live replica of {deployment}"
    return actors


def _replica_actor(deployment: str):
    return _replica_actors(deployment)[0]


def _job_state(alloy_service, job_id: str) -> str:
    from alloy.jobs.store import JobStore
    from alloy.storage.db import Database

    db = Database(alloy_service.database_url)
    try:
        return JobStore(db).get(job_id).state.value
    finally:
        db.close()


def test_merge_survives_the_ingress_replica_being_killed(alloy_service, served_models, big_models):
    import ray

    body = {
        "models": big_models,
        "strategy": "ties",
        "base_model": "bigbase",
        "parameters": {"density": 0.5},
        "output_model_id": "survivor",
    }
    accepted = alloy_service.client("write").post("/merge/execute", json=body)
    assert accepted.status_code == 202, accepted.text
    job_id = accepted.json()["job_id"]

    assert _job_state(alloy_service, job_id) not in ("COMPLETED", "FAILED")
    ray.kill(_replica_actor("Ingress"), no_restart=True)

    job = (
        alloy_service.wait_job(accepted.json()["progress_url"], timeout_s=300)
        if _ingress_back(alloy_service)
        else pytest.fail("the ingress did not come back")
    )
    assert job["state"] == "COMPLETED", job
    assert job["attempts"] == 0  # not replayed: the engine, not the ingress, owned it
    assert alloy_service.client("read").get("/models/survivor").status_code == 200


def _ingress_back(alloy_service, timeout_s: float = 180.0) -> bool:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if alloy_service.client("read").get("/health", timeout=10).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    return False


def test_two_concurrent_merges_both_complete(alloy_service, served_models):
    client = alloy_service.client("write")
    first = client.post("/merge/execute", json=merge_body("pair-a"))
    second = client.post("/merge/execute", json=merge_body("pair-b", models=["tune2", "tune3"]))
    assert first.status_code == second.status_code == 202
    assert first.json()["job_id"] != second.json()["job_id"]
    jobs = [alloy_service.wait_job(r.json()["progress_url"]) for r in (first, second)]
    assert [j["state"] for j in jobs] == ["COMPLETED", "COMPLETED"], jobs
    assert {j["model_id"] for j in jobs} == {"pair-a", "pair-b"}
    # the same output id cannot be claimed twice
    again = client.post("/merge/execute", json=merge_body("pair-a"))
    assert again.status_code == 409


def test_a_failed_merge_leaves_nothing_registered(alloy_service, served_models, tiny_model_factory):
    alloy_service.register_model("fragile", tiny_model_factory("llama", seed=31, base=served_models["base"]))
    # The operator loses the model's files behind the registry's back: validation (manifest from the database)
    # passes, the merge itself cannot read the weights.
    stored = alloy_service.data_dir / "artifacts" / "models" / "fragile"
    for weights in stored.glob("*.safetensors"):
        weights.unlink()

    accepted = alloy_service.client("write").post(
        "/merge/execute", json=merge_body("doomed", models=["tune1", "fragile"])
    )
    assert accepted.status_code == 202, accepted.text
    job = alloy_service.wait_job(accepted.json()["progress_url"])

    assert job["state"] == "FAILED"
    assert job["error"]["code"] and job["error"]["message"]
    assert job["model_id"] is None
    reader = alloy_service.client("read")
    assert reader.get("/models/doomed").json()["error"]["code"] == "MODEL_NOT_FOUND"
    assert reader.get("/artifacts", params={"prefix": "models/doomed"}).json() == []
    work = alloy_service.data_dir / "work" / "merges"
    assert not work.exists() or not any(p.name.startswith(job["job_id"]) for p in work.iterdir())
    shutil.rmtree(stored, ignore_errors=True)


RECOVERY_S = 30.0  # the bound: a job of a killed replica runs again within 30 s of the kill


def job_events(alloy_service, job_id: str):
    from alloy.jobs.store import JobStore
    from alloy.storage.db import Database

    db = Database(alloy_service.database_url)
    try:
        return JobStore(db).events(job_id)
    finally:
        db.close()


def assert_recovered_once(alloy_service, job: dict, killed_at: float) -> float:
    """One interruption (``interrupted`` by a sweeper, ``attempts`` 1) and the replay claimed the job within
    RECOVERY_S of the kill; returns the seconds from the kill to the replay."""
    assert job["state"] == "COMPLETED", job
    assert job["attempts"] == 1, job
    events = job_events(alloy_service, job["job_id"])
    [interrupted] = [e for e in events if e.event == "interrupted"]
    assert "owner lost" in interrupted.reason
    [replayed] = [e for e in events if e.event == "replayed"]
    recovered_s = replayed.at.timestamp() - killed_at
    assert 0 < recovered_s <= RECOVERY_S, (recovered_s, [(e.event, e.at, e.reason) for e in events])
    return recovered_s


def scratch_of(alloy_service, job_id: str, output: str) -> list:
    """What a run of the job may leave: its work folder and the staging folders of its output's registration."""
    work = alloy_service.data_dir / "work" / "merges" / job_id
    staging = alloy_service.data_dir / "artifacts" / ".staging"
    return ([work] if work.exists() else []) + (list(staging.glob(f"models~{output}.*")) if staging.exists() else [])


def test_kill_9_of_a_merge_engine_replica_mid_merge_recovers_within_30_s_and_leaves_no_scratch(
    alloy_service, big_models
):
    """The replica running the merge is killed outright (no shutdown hook): Serve replaces it, the new replica's
    sweeper finds the job's lease lapsed (10 s in the test app), removes the dead run's work folder, requeues the
    job (``interrupted``, one attempt) and replays it to COMPLETED: within 30 s of the kill plus its own run."""
    import ray

    body = {
        "models": big_models,
        "strategy": "ties",
        "base_model": "bigbase",
        "parameters": {"density": 0.5},
        "output_model_id": "phoenix",
    }
    accepted = alloy_service.client("write").post("/merge/execute", json=body)
    assert accepted.status_code == 202, accepted.text
    job_id = accepted.json()["job_id"]

    deadline = time.monotonic() + 60
    while not (_job_state(alloy_service, job_id) == "RUNNING" and scratch_of(alloy_service, job_id, "phoenix")):
        assert time.monotonic() < deadline, _job_state(alloy_service, job_id)
        time.sleep(0.05)
    # Every MergeEngine replica (autoscaling may have started a second one under load): the one running the job
    # is among them, and no other replica keeps the job's lease alive.
    for replica in _replica_actors("MergeEngine"):
        ray.kill(replica, no_restart=True)
    killed_at = time.time()
    assert scratch_of(alloy_service, job_id, "phoenix")  # the dead run's output folder, half written

    job = alloy_service.wait_job(accepted.json()["progress_url"], timeout_s=300)
    recovered_s = assert_recovered_once(alloy_service, job, killed_at)
    print(f"merge replayed {recovered_s:.1f}s after the kill, COMPLETED {time.time() - killed_at:.1f}s after it")
    assert alloy_service.client("read").get("/models/phoenix").status_code == 200
    assert scratch_of(alloy_service, job_id, "phoenix") == []


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-17] ^= 0xFF  # tensor data: the same size, a different sha256
    path.write_bytes(data)


def test_a_bit_flipped_input_fails_the_merge_naming_it_and_nothing_is_registered(
    alloy_service, served_models, tiny_model_factory
):
    alloy_service.register_model("rotten", tiny_model_factory("llama", seed=41, base=served_models["base"]))
    flip_a_byte(alloy_service.data_dir / "artifacts" / "models" / "rotten" / "model.safetensors")
    client = alloy_service.client("write")

    accepted = client.post("/merge/execute", json=merge_body("from-rotten", models=["tune1", "rotten"]))
    assert accepted.status_code == 202, accepted.text  # nothing was known to be wrong yet
    job = alloy_service.wait_job(accepted.json()["progress_url"])

    assert job["state"] == "FAILED" and job["error"]["code"] == "VALIDATION_FAILED", job
    message = job["error"]["message"]
    assert "model 'rotten' is damaged" in message and "'model.safetensors'" in message, message
    assert str(alloy_service.data_dir) not in message
    reader = alloy_service.client("read")
    assert reader.get("/models/from-rotten").status_code == 404
    assert reader.get("/artifacts", params={"prefix": "models/from-rotten"}).json() == []
    assert "model.safetensors" in reader.get("/models/rotten").json()["broken"]
    assert reader.get("/models/tune1").json()["broken"] is None
    assert scratch_of(alloy_service, job["job_id"], "from-rotten") == []

    again = client.post("/merge/execute", json=merge_body("from-rotten", models=["tune2", "rotten"]))
    assert again.status_code == 422 and again.json()["error"]["code"] == "VALIDATION_FAILED", again.text
    assert "damaged" in again.json()["error"]["message"]  # refused at once until registered again
