"""DatasetRegistry on SQLite and PostgreSQL with a local store; registration and reads also on S3."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alloy.errors import AlloyError, ErrorCode
from alloy.registry.datasets import DatasetRegistry

TASK = {"type": "classification", "text_field": "text", "label_field": "label", "labels": ["neg", "pos"]}


@pytest.fixture
def datasets(database, tmp_path):
    from alloy.storage.artifacts import ArtifactStore

    return DatasetRegistry(database, ArtifactStore(tmp_path / "artifacts"))


@pytest.fixture
def any_store_datasets(database, artifact_store):
    """The registry over the local store and over S3."""
    return DatasetRegistry(database, artifact_store)


@pytest.fixture
def files(tmp_path):
    train = tmp_path / "train.parquet"
    pq.write_table(pa.table({"text": ["good", "bad", "fine"], "label": [1, 0, 1]}), train)
    test = tmp_path / "test.jsonl"
    test.write_text(
        "\n".join(json.dumps({"text": t, "label": label}) for t, label in [("meh", 0), ("great", 1)]) + "\n"
    )
    return {"train": train, "test": test}


def test_register_splits_schema_and_row_counts(any_store_datasets, files):
    record = any_store_datasets.register("sentiment", files, task=TASK, description="tiny", owner="alice")
    assert record.schema_fields == {"text": "string", "label": "int64"}
    assert {n: s.rows for n, s in record.splits.items()} == {"train": 3, "test": 2}
    assert record.row_count == 5 and record.task == TASK and record.owner == "alice"
    assert record.splits["test"].source_format == "jsonl" and len(record.splits["test"].sha256) == 64
    assert any_store_datasets.get("sentiment") == record
    test = any_store_datasets.read_split("sentiment", "test")
    assert test.column("text").to_pylist() == ["meh", "great"]
    assert any_store_datasets.read_split("sentiment", "train").num_rows == 3


def test_single_file_is_the_train_split(datasets, files):
    record = datasets.register("wiki", files["test"], task={"type": "perplexity", "text_field": "text"})
    assert list(record.splits) == ["train"] and record.task == {"type": "perplexity", "text_field": "text"}


def test_refusals(datasets, files, tmp_path):
    datasets.register("d", files["train"])
    cases = [
        (lambda: datasets.register("d", files["train"]), ErrorCode.ALREADY_EXISTS),
        (lambda: datasets.register("../d", files["train"]), ErrorCode.VALIDATION_FAILED),
        (lambda: datasets.register("e", tmp_path / "missing.parquet"), ErrorCode.VALIDATION_FAILED),
        (
            lambda: datasets.register("e", files, task={"type": "classification", "text_field": "text"}),
            ErrorCode.VALIDATION_FAILED,
        ),
        (
            lambda: datasets.register("e", files, task={"type": "perplexity", "text_field": "body"}),
            ErrorCode.VALIDATION_FAILED,
        ),
        (lambda: datasets.register("e", {"bad split!": files["train"]}), ErrorCode.VALIDATION_FAILED),
        # a home of a user that does not exist (pathlib's expanduser raised RuntimeError: a 500 the fuzzer found)
        (lambda: datasets.register("e", '~w,:d/&/:0a"1s/BDX=e6JB'), ErrorCode.VALIDATION_FAILED),
        (lambda: datasets.read_split("d", "validation"), ErrorCode.NOT_FOUND),
        (lambda: datasets.get("nope"), ErrorCode.NOT_FOUND),
    ]
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n1,2\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    cases += [
        (lambda: datasets.register("e", csv), ErrorCode.VALIDATION_FAILED),
        (lambda: datasets.register("e", broken), ErrorCode.VALIDATION_FAILED),
    ]
    for call, code in cases:
        with pytest.raises(AlloyError) as caught:
            call()
        assert caught.value.code is code
    assert not datasets.exists("e")


def test_roots_confine_dataset_files(datasets, files, tmp_path_factory):
    confined = DatasetRegistry(datasets.db, datasets.store, roots=[tmp_path_factory.mktemp("only-here")])
    with pytest.raises(AlloyError) as caught:
        confined.register("d", files["train"])
    assert caught.value.code is ErrorCode.VALIDATION_FAILED


def test_list_and_delete(datasets, files):
    for name in ("b", "a", "c"):
        datasets.register(name, files["train"])
    page = datasets.list(limit=2)
    assert page.total == 3 and [d.id for d in page.items] == ["a", "b"]
    datasets.delete("a")
    assert not datasets.exists("a") and datasets.store.list("datasets/a") == []
    assert [d.id for d in datasets.list().items] == ["b", "c"]
    with pytest.raises(AlloyError):
        datasets.delete("a")
