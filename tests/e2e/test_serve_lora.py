"""LoRA adapters over real HTTP through the Serve proxy: a PEFT adapter folder registered with POST /models (kind
detected from its adapter_config.json), listed and read back; a merge naming ``base-id+adapter-id`` (as a model
and as the base) completes and its tensors equal ``alloy merge`` of the same recipe with the same base+adapter;
an unknown adapter (404 MODEL_NOT_FOUND), an adapter that does not fit its base (422 INCOMPATIBLE_MODELS) and an
adapter used alone are refused at submit, before any job exists; a pickled adapter is refused at registration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.mergekit_diff import load_folder
from bench.pico_models import build_pico_adapter

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def adapters(alloy_service, served_models, tiny_model_factory, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    fitting = build_pico_adapter(root / "lora", served_models["base"], seed=4)
    wide = tiny_model_factory("llama", seed=9, hidden=64)  # its adapter's shapes do not fit the 32-wide base
    unfit = build_pico_adapter(root / "wide-lora", wide, seed=5)
    for adapter_id, folder in (("lora1", fitting), ("wide-lora", unfit)):
        alloy_service.register_model(adapter_id, folder)
    return {"lora1": fitting, "wide-lora": unfit}


def body(output: str, **changes):
    return {
        "models": ["base+lora1", "tune1", "tune2"],
        "strategy": "ties",
        "base_model": "base+lora1",
        "parameters": {"density": 0.5},
        "output_model_id": output,
        **changes,
    }


def test_an_adapter_registers_and_reads_back_as_an_adapter(alloy_service, adapters):
    reader = alloy_service.client("read")
    view = reader.get("/models/lora1").json()
    assert view["kind"] == "adapter" and view["architecture"] is None
    assert view["parameter_count"] > 0
    listed = {m["id"]: m["kind"] for m in reader.get("/models", params={"limit": 500}).json()["items"]}
    assert listed["lora1"] == "adapter" and listed["base"] == "model"


def test_a_pickled_adapter_is_refused_at_registration(alloy_service, adapters, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pickled")
    (folder / "adapter_config.json").write_text((adapters["lora1"] / "adapter_config.json").read_text())
    (folder / "adapter_model.bin").write_bytes(b"not even a pickle")
    response = alloy_service.client().post("/models", json={"model_id": "pickled-lora", "source": str(folder)})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "VALIDATION_FAILED" and "pickle" in error["message"]
    assert str(folder) not in error["message"]


@pytest.mark.parametrize(
    ("changes", "status", "code"),
    [
        ({"models": ["base+ghost", "tune1"], "base_model": "base"}, 404, "MODEL_NOT_FOUND"),
        ({"models": ["base+wide-lora", "tune1"], "base_model": "base+wide-lora"}, 422, "INCOMPATIBLE_MODELS"),
        ({"models": ["lora1", "tune1"], "base_model": "tune1"}, 422, "VALIDATION_FAILED"),
        ({"models": ["base+tune2", "tune1"], "base_model": "tune1"}, 422, "VALIDATION_FAILED"),
    ],
)
def test_bad_adapter_references_are_refused_at_submit(alloy_service, adapters, changes, status, code):
    client = alloy_service.client("write")
    before = client.get("/jobs", params={"kind": "merge"}).json()["total"]
    response = client.post("/merge/execute", json=body("never-made", **changes))
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    assert client.get("/jobs", params={"kind": "merge"}).json()["total"] == before  # no job was created


def test_a_merge_of_base_plus_adapter_equals_alloy_merge(alloy_service, served_models, adapters, tmp_path):
    client = alloy_service.client("write")
    response = client.post("/merge/execute", json=body("lora-merged"))
    assert response.status_code == 202, response.text
    job = alloy_service.wait_job(response.json()["progress_url"])
    assert job["state"] == "COMPLETED", job

    reader = alloy_service.client("read")
    served = tmp_path / "served"
    served.mkdir()
    for artifact in reader.get("/artifacts", params={"prefix": "models/lora-merged/"}).json():
        download = reader.get(artifact["download_url"])
        assert download.status_code == 200
        (served / Path(artifact["key"]).name).write_bytes(download.content)

    from alloy.cli.merge import resolve_source
    from alloy.merge.executor import execute_merge
    from alloy.merge.mergekit import load_recipe_yaml

    base, adapter = served_models["base"], adapters["lora1"]
    recipe = {
        "strategy": "ties",
        "models": [f"{base}+{adapter}", str(served_models["tune1"]), str(served_models["tune2"])],
        "base_model": f"{base}+{adapter}",
        "parameters": {"density": 0.5},
    }
    parsed = load_recipe_yaml(json.dumps(recipe))  # what ``alloy merge recipe.yml`` reads
    local = execute_merge(parsed, {m: resolve_source(m, tmp_path) for m in parsed.model_ids}, tmp_path / "local")
    ours, theirs = load_folder(served), load_folder(local.out_dir)
    assert set(ours) == set(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    # The adapter was folded in: without it the targeted q_proj differs and the untargeted k_proj does not.
    recipe.update(models=[str(base), *recipe["models"][1:]], base_model=str(base))
    parsed = load_recipe_yaml(json.dumps(recipe))
    without = load_folder(execute_merge(parsed, {m: Path(m) for m in parsed.model_ids}, tmp_path / "plain").out_dir)
    assert not torch.equal(
        ours["model.layers.0.self_attn.q_proj.weight"], without["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(
        ours["model.layers.0.self_attn.k_proj.weight"], without["model.layers.0.self_attn.k_proj.weight"]
    )
