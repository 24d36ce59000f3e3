"""The pure part of a fanned-out merge: the shard layout is the one the streaming writer makes, groups are
contiguous byte-balanced runs of whole shards, and a group writes exactly the whole merge's files for its shards.
Also the request's ``parallelism`` field."""

from __future__ import annotations

import hashlib

import pytest
import torch
from pydantic import ValidationError

from alloy.config import MergeSettings
from alloy.jobs.merge_fanout import fanout_groups
from alloy.jobs.merge_request import MergeRequest
from alloy.merge.executor import execute_merge, prepare
from alloy.merge.fanout import Shard, ShardLayout, shard_layout, split_groups
from alloy.merge.recipe import MergeRecipe, ModelRef
from alloy.merge.tensor_io import INDEX_FILE
from alloy.model_manifest import read_manifest

torch.set_num_threads(1)
SHARD_BYTES = 20 * 1024


def _layout(sizes: list[int]) -> ShardLayout:
    return ShardLayout(tuple(Shard(i + 1, f"s{i + 1}", (f"t{i + 1}",), size) for i, size in enumerate(sizes)))


@pytest.mark.parametrize(
    "sizes, groups, expected",
    [
        ([10, 10, 10, 10], 2, [(1, 2), (3, 4)]),
        ([10, 10, 10, 10], 4, [(1,), (2,), (3,), (4,)]),
        ([10, 10, 10], 8, [(1,), (2,), (3,)]),  # never more groups than shards
        ([100, 1, 1, 1], 2, [(1,), (2, 3, 4)]),  # balanced by bytes, not by count
        ([1, 1, 1, 100], 2, [(1, 2, 3), (4,)]),
        ([5, 5, 5, 5, 5, 5, 5], 3, [(1, 2, 3), (4, 5), (6, 7)]),
        ([7], 3, [(1,)]),
    ],
)
def test_groups_are_contiguous_byte_balanced_runs(sizes, groups, expected):
    runs = split_groups(_layout(sizes), groups)
    assert runs == expected
    assert [n for run in runs for n in run] == list(range(1, len(sizes) + 1))  # every shard once, in order


@pytest.fixture(scope="module")
def family(tiny_family):
    base, tunes = tiny_family
    return {"base": base, "t1": tunes[0], "t2": tunes[1], "t3": tunes[2]}


def _recipe() -> MergeRecipe:
    # dare_ties draws random masks: per-tensor seeds make them independent of which group computes a tensor
    return MergeRecipe(
        strategy="dare",
        variant="dare_ties",
        models=[ModelRef(model=m) for m in ("t1", "t2", "t3")],
        base_model="base",
        parameters={"density": 0.5, "weight": 0.6},
        seed=99,
    )


def test_groups_write_the_whole_merges_shards_byte_for_byte(family, tmp_path):
    whole = execute_merge(_recipe(), family, tmp_path / "whole", shard_bytes=SHARD_BYTES)
    manifests = {m: read_manifest(family[m]) for m in family}
    layout = shard_layout(prepare(_recipe(), manifests), SHARD_BYTES)
    assert len(layout.shards) >= 3
    assert [s.name for s in layout.shards] == read_manifest(whole.out_dir).shards
    assert layout.index_text() == (whole.out_dir / INDEX_FILE).read_text()
    written = {}
    for index, run in enumerate(split_groups(layout, 3)):
        part = execute_merge(_recipe(), family, tmp_path / f"group{index}", shard_bytes=SHARD_BYTES, shards=run)
        files = sorted(p.name for p in part.out_dir.iterdir())
        assert files == [layout.shards[n - 1].name for n in run]  # its shards and nothing else
        assert part.manifest is None and part.bytes == sum(layout.shards[n - 1].nbytes for n in run)
        written.update({name: (part.out_dir / name).read_bytes() for name in files})
    for name, data in written.items():
        assert hashlib.sha256(data).digest() == hashlib.sha256((whole.out_dir / name).read_bytes()).digest()


def test_parallelism_is_bounded_and_not_combined_with_evaluate():
    base = {"models": ["a", "b"], "strategy": "ties", "output_model_id": "out"}
    assert MergeRequest(**base, parallelism=4).parallelism == 4
    assert MergeRequest(**base).recipe().model_ids == ["a", "b"]  # the field stays out of the recipe
    for bad in (0, 65):
        with pytest.raises(ValidationError):
            MergeRequest(**base, parallelism=bad)
    with pytest.raises(ValidationError, match="evaluate"):
        MergeRequest(**base, parallelism=2, evaluate={"datasets": ["d"]})
    assert MergeRequest(**base, parallelism=1, evaluate={"datasets": ["d"]}).parallelism == 1


def _shards(count: int, nbytes: int = 1024) -> ShardLayout:
    return _layout([nbytes] * count)


@pytest.mark.parametrize(
    "parallelism, evaluate, layout, threshold, expected",
    [
        (4, None, _shards(8), None, 4),  # asked for
        (1, None, _shards(8), 1, None),  # one process, asked for: the threshold does not apply
        (None, None, _shards(8), 8 * 1024, 3),  # at the threshold: the configured groups
        (None, None, _shards(8), 8 * 1024 + 1, None),  # below it
        (None, None, _shards(8), None, None),  # no threshold: only on request
        (None, {"datasets": ["d"]}, _shards(8), 1, None),  # evaluate keeps the output on one node
        (4, None, _shards(1), None, None),  # one shard cannot be split
    ],
)
def test_when_a_merge_is_fanned_out(parallelism, evaluate, layout, threshold, expected):
    request = MergeRequest(
        models=["a", "b"], strategy="ties", output_model_id="out", parallelism=parallelism, evaluate=evaluate
    )
    settings = MergeSettings(fanout_threshold_bytes=threshold, fanout_groups=3)
    assert fanout_groups(request, layout, settings) == expected
