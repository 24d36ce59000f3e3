"""One merge as several groups of output shards: the pure part of a fanned-out merge (no Ray, no I/O).

The shard layout of a merge is fixed by its plan and ``shard_bytes`` alone (:func:`shard_layout`, the same cut
the streaming executor makes), so a group that computes a run of whole shards writes exactly the files, byte for
byte, that the single-process merge writes for them (``execute_merge(..., shards=...)``): per-tensor seeds make
the random methods independent of who computes a tensor and in which order. The coordinator then writes what
spans the whole model (the index, config and model card) and publishes the folder only when every group
succeeded; the result is bit-identical to the single-process merge.

Groups are contiguous runs of shards balanced by bytes (:func:`split_groups`); what each group reports back is a
:class:`GroupResult` (its files with sizes and sha256, their safetensors headers) and, while it runs,
:class:`GroupProgress` events that the coordinator sums into the job's progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from alloy.merge.executor import output_tensors
from alloy.merge.plan import MergePlan
from alloy.merge.tensor_io import index_text, shard_name, split_into_shards


@dataclass(frozen=True)
class Shard:
    number: int  # from 1, as in the file name
    name: str  # model-0000i-of-0000n.safetensors
    tensors: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class ShardLayout:
    shards: tuple[Shard, ...]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def tensor_count(self) -> int:
        return sum(len(s.tensors) for s in self.shards)

    def weight_map(self) -> dict[str, str]:
        return {name: shard.name for shard in self.shards for name in shard.tensors}

    def index_text(self) -> str:
        """The index file, as the single-process merge writes it."""
        return index_text(self.weight_map(), self.total_bytes)


def shard_layout(plan: MergePlan, shard_bytes: int) -> ShardLayout:
    """The output shards of ``plan``: the cut :class:`alloy.merge.tensor_io.ShardedWriter` makes."""
    cut = split_into_shards(output_tensors(plan), shard_bytes)
    return ShardLayout(
        tuple(
            Shard(number, shard_name(number, len(cut)), tuple(t.name for t in members), sum(t.nbytes for t in members))
            for number, members in enumerate(cut, start=1)
        )
    )


def split_groups(layout: ShardLayout, groups: int) -> list[tuple[int, ...]]:
    """At most ``groups`` contiguous runs of shard numbers, balanced by bytes (every run non-empty): each run
    ends at the shard where the running total first reaches its even share."""
    count = max(1, min(groups, len(layout.shards)))
    total = layout.total_bytes
    runs: list[tuple[int, ...]] = []
    current: list[int] = []
    done = 0
    for position, shard in enumerate(layout.shards):
        current.append(shard.number)
        done += shard.nbytes
        left_shards = len(layout.shards) - position - 1
        left_runs = count - len(runs) - 1
        share_reached = total and done * count >= total * (len(runs) + 1)
        if left_runs > 0 and (share_reached or left_shards == left_runs):
            runs.append(tuple(current))
            current = []
    runs.append(tuple(current))
    return [run for run in runs if run]


class GroupSpec(BaseModel):
    """What one group is asked to do."""

    job_id: str
    index: int  # 0-based group number
    shards: list[int]  # shard numbers (from 1)
    shard_bytes: int  # the layout's cut: every group must use the coordinator's
    staging_id: str  # where in the artifact store's staging its files go
    attempt: int = 0


class GroupFile(BaseModel):
    name: str
    size: int
    sha256: str


class GroupProgress(BaseModel):
    index: int
    tensors_done: int
    bytes_done: int


class GroupResult(BaseModel):
    index: int
    files: list[GroupFile]
    headers: dict[str, dict[str, Any]] = Field(description="each written shard's safetensors header")
    tensors: int
    bytes: int
    seconds: float  # fetch + merge + upload
    fetch_s: float = 0.0  # the inputs into this node's cache (0 when cached)
    upload_s: float = 0.0  # its shards into the artifact store's staging
    node: str | None = None  # where it ran, for the job's record
    attempt: int = 0
