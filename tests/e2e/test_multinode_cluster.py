"""Alloy on a real multi-node Ray cluster (:mod:`tests.fixtures.multinode`: a head and two worker raylets on this
machine, PostgreSQL, moto's S3 server), every request through the Serve proxy.

In order (the module shares one cluster, and the last two tests change it): the storage rule on several nodes;
a merge on a worker that has never seen its inputs (node-local cache, atomic publish); an evolution whose trials
run on both workers; a merge fanned out over both workers, bit-identical to the single-process merge; a worker
killed mid-merge (its job requeued and completed on another node, registry consistent); a worker drained
mid-merge (the merge finishes, nothing new starts there, ``/health`` lists it as draining).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tests.fixtures.multinode import MultiNodeCluster

pytestmark = [pytest.mark.ray, pytest.mark.postgres]

ROOT = Path(__file__).resolve().parents[2]
BIG = {"layers": 8, "hidden": 384, "vocab": 8192}  # ~70 MB each: a merge takes seconds (as in test_serve_merge)


@pytest.fixture(scope="module")
def family(multinode: MultiNodeCluster, tiny_family, tiny_model_factory) -> dict[str, Path]:
    """The tiny family and two big fine-tunes, registered through HTTP (the head's registry copies them to S3)."""
    base, tunes = tiny_family
    big_base = tiny_model_factory("llama", seed=20, **BIG)
    folders = {
        "base": base,
        "tune1": tunes[0],
        "tune2": tunes[1],
        "tune3": tunes[2],
        "bigbase": big_base,
        "big1": tiny_model_factory("llama", seed=21, base=big_base, **BIG),
        "big2": tiny_model_factory("llama", seed=22, base=big_base, **BIG),
    }
    for model_id, path in folders.items():
        multinode.register_model(model_id, path)
    return folders


def merge_body(output: str, models=("tune1", "tune2"), base="base", **changes) -> dict[str, Any]:
    return {
        "models": list(models),
        "strategy": "ties",
        "base_model": base,
        "parameters": {"density": 0.5},
        "output_model_id": output,
        **changes,
    }


def submit(multinode: MultiNodeCluster, body: dict[str, Any]) -> dict[str, Any]:
    response = multinode.service.client("write").post("/merge/execute", json=body)
    assert response.status_code == 202, response.text
    return response.json()


def wait_running_on(multinode: MultiNodeCluster, job_id: str, timeout_s: float = 180.0) -> str:
    """The worker whose merge scratch holds the job while it merges (its tensors are being written there)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        node = multinode.node_running(job_id)
        if node is not None:
            return node
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} never merged on a worker")


def explain(multinode: MultiNodeCluster, job: dict[str, Any]) -> str:
    """A job and its events, whole (pytest cuts a dict's repr short): what a failed assertion needs to say."""
    events = multinode.service.client("read").get(f"/jobs/{job['job_id']}/events").json()
    return f"{job}\nevents: {events}"


def node_name(multinode: MultiNodeCluster, node_id: str) -> str:
    return {v: k for k, v in multinode.node_ids.items()}[node_id]


# -- the cluster and the storage rule ------------------------------------------------------------------------


def test_every_node_is_listed_and_the_engines_run_on_workers(multinode):
    print(f"multinode harness: {multinode.timings}")
    health = multinode.service.client("read").get("/health").json()
    assert health["status"] == "healthy" and health["cluster_state"] == "READY"
    alive = {n["node_id"] for n in health["nodes"] if n["alive"]}
    assert alive == set(multinode.node_ids.values()) and len(alive) == 3
    assert health["components"]["MergeEngine"]["detail"]["node"] in {multinode.node_ids["w1"], multinode.node_ids["w2"]}
    assert health["draining_nodes"] == []


def test_node_local_storage_is_refused_on_several_nodes(multinode, tmp_path):
    """The app builder, on a driver of this 3-node cluster, with the default SQLite database and local artifact
    folder: refused before anything is deployed (the multi-node storage rule); the running app is untouched."""
    outcome = multinode.driver(
        "build-refused",
        {**multinode.app_payload, "refused_settings": {"data_dir": str(tmp_path), "model_roots": []}},
    )
    assert outcome["nodes"] == 3 and outcome["code"] == "VALIDATION_FAILED", outcome
    assert "this Ray cluster has 3 nodes, which needs shared storage" in outcome["message"]
    assert "database.url is SQLite" in outcome["message"] and "artifacts.uri is a local folder" in outcome["message"]
    assert outcome["details"]["alive_nodes"] == 3
    assert multinode.service.client("read").get("/health").json()["status"] == "healthy"


# -- work on worker nodes ------------------------------------------------------------------------------------


def test_a_worker_fetches_its_inputs_into_its_own_cache_and_publishes_atomically(multinode, family):
    accepted = submit(multinode, merge_body("first-merge"))
    job = multinode.service.wait_job(accepted["progress_url"])
    assert job["state"] == "COMPLETED", explain(multinode, job)
    worker = node_name(multinode, job["result"]["node"])
    other = {"w1": "w2", "w2": "w1"}[worker]
    assert worker in ("w1", "w2")
    assert multinode.cached_models(worker) == {"tune1", "tune2", "base"}  # downloaded from S3 by this node
    assert multinode.cached_models(other) == set() and multinode.cached_models("head") == set()
    assert multinode.merge_scratch(worker, job["job_id"]) == []

    store = multinode.store()
    assert store.dir_exists("models/first-merge")  # published: manifest written, no pending marker left
    assert not store.fs.exists(f"{store.root}/models/first-merge/.alloy-pending")
    record = multinode.service.client("read").get("/models/first-merge").json()
    assert record["artifact_prefix"] == "models/first-merge" and record["lineage"]["job_id"] == job["job_id"]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _trial_nodes(multinode: MultiNodeCluster) -> set[str]:
    """Workers with a Tune trial actor (``ray::ImplicitFunc``) among the processes their raylet started."""
    found = set()
    for name, node in multinode.workers.items():
        for pid in node.pids():
            try:
                if "ImplicitFunc" in " ".join(psutil.Process(pid).cmdline()):
                    found.add(name)
                    break
            except psutil.Error:
                continue
    return found


def test_an_evolution_runs_its_trials_on_both_workers(multinode):
    request = yaml.safe_load((ROOT / "configs" / "evolve-tiny.yaml").read_text())
    request["search"].update(population=4, generations=1, finalists=1)  # 4 x 0.5 CPU: more than one worker holds
    request["name"] = "evolution on two workers"
    client = multinode.service.client("write")
    accepted = client.post("/evolutions", json=request)
    assert accepted.status_code == 202, accepted.text
    url = accepted.json()["progress_url"]
    seen: set[str] = set()
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        seen |= _trial_nodes(multinode)
        view = client.get(url).json()
        if view["state"] in ("COMPLETED", "FAILED"):
            break
        time.sleep(0.5)
    assert view["state"] == "COMPLETED", view
    assert seen == {"w1", "w2"}


def test_a_fanned_out_merge_runs_on_both_workers_and_is_bit_identical(multinode, family):
    """The same request in one process and fanned out over two groups: the published folders have the same
    files with the same sha256 (the store's manifest of each), random masks included."""
    body = {
        "models": ["tune1", "tune2", "tune3"],
        "strategy": "dare",
        "variant": "dare_ties",  # random masks: per-tensor seeds keep them independent of the group
        "base_model": "base",
        "parameters": {"density": 0.6, "weight": 0.5},
        "seed": 4321,
    }
    fanned = submit(multinode, {**body, "output_model_id": "fanned", "parallelism": 2})
    single = submit(multinode, {**body, "output_model_id": "single", "parallelism": 1})
    job = multinode.service.wait_job(fanned["progress_url"])
    assert job["state"] == "COMPLETED", explain(multinode, job)
    groups = job["result"]["merge"]["groups"]
    assert len(groups) == 2 and {node_name(multinode, g["node"]) for g in groups} == {"w1", "w2"}
    assert job["tensors_done"] == job["tensors_total"] == job["result"]["merge"]["tensors"]
    one = multinode.service.wait_job(single["progress_url"])
    assert one["state"] == "COMPLETED" and "groups" not in one["result"]["merge"], one

    store = multinode.store()
    files = {
        prefix: {f.key.rsplit("/", 1)[1]: f.sha256 for f in store.dir_manifest(f"models/{prefix}")}
        for prefix in ("fanned", "single")
    }
    assert files["fanned"] == files["single"]
    assert sum(name.endswith(".safetensors") for name in files["fanned"]) == job["result"]["merge"]["shards"] >= 2


# -- losing and draining workers (these change the cluster: keep them last) ---------------------------------


def test_a_worker_killed_mid_merge_has_its_job_requeued_and_completed_on_another_node(multinode, family):
    multinode.add_worker("w3")  # what an autoscaler does: capacity for the replicas the lost node ran
    output = f"survivor-{uuid.uuid4().hex[:6]}"
    accepted = submit(multinode, merge_body(output, models=("big1", "big2"), base="bigbase"))
    victim = wait_running_on(multinode, accepted["job_id"])
    killed = multinode.kill_worker(victim)  # kill -9: raylet, agents and workers, by the PIDs we started
    assert killed and not [pid for pid in killed if _running(pid)]

    job = multinode.service.wait_job(accepted["progress_url"], timeout_s=300)
    assert job["state"] == "COMPLETED", explain(multinode, job)
    assert job["attempts"] >= 1 and node_name(multinode, job["result"]["node"]) != victim
    client = multinode.service.client("read")
    events = [e["event"] for e in client.get(f"/jobs/{accepted['job_id']}/events").json()]
    assert "interrupted" in events and "replayed" in events

    # The registry and the store agree: one record, one complete folder, every sha256 right.
    record = client.get(f"/models/{output}").json()
    assert record["lineage"]["job_id"] == accepted["job_id"]
    store = multinode.store()
    files = store.dir_manifest(f"models/{output}")
    assert {f.key.rsplit("/", 1)[1] for f in files} >= set(record["shards"]) | {"config.json"}
    alive = {n["node_id"] for n in client.get("/health").json()["nodes"] if n["alive"]}
    assert multinode.node_ids[victim] not in alive


def test_a_drained_worker_finishes_its_merge_and_starts_nothing_new(multinode, family):
    admin = multinode.service.client("admin")
    first = submit(multinode, merge_body(f"drained-{uuid.uuid4().hex[:6]}", models=("big1", "big2"), base="bigbase"))
    worker = wait_running_on(multinode, first["job_id"])
    node_id = multinode.node_ids[worker]
    drained = admin.post("/admin/drain", json={"node_id": node_id, "reason": "maintenance"})
    assert drained.status_code == 200, drained.text
    assert drained.json() == {"node_id": node_id, "accepted": True, "message": None}
    assert admin.get(first["progress_url"]).json()["state"] == "RUNNING"  # drained while it merges
    assert admin.get("/health").json()["draining_nodes"] == [node_id]

    later = [submit(multinode, merge_body(f"after-drain-{i}-{uuid.uuid4().hex[:6]}")) for i in range(2)]
    done = multinode.service.wait_job(first["progress_url"], timeout_s=300)
    assert done["state"] == "COMPLETED" and done["result"]["node"] == node_id, explain(multinode, done)
    for accepted in later:
        job = multinode.service.wait_job(accepted["progress_url"], timeout_s=300)
        assert job["state"] == "COMPLETED" and job["result"]["node"] != node_id, explain(multinode, job)
    # Once Serve has moved its replicas away and its work is done, the drained raylet leaves the cluster.
    health = admin.get("/health").json()
    alive = {n["node_id"] for n in health["nodes"] if n["alive"]}
    assert health["draining_nodes"] == ([node_id] if node_id in alive else [])
