"""Streaming safetensors I/O without memory maps.

Reading a tensor through a memory map leaves its pages mapped in the process (they count in its resident set
until the map is closed), so a streamed merge of several large models would look as big as the models.
:class:`SafetensorsReader` reads each tensor (or a piece of one) with ``pread`` into a fresh buffer the merge then
owns. :class:`ShardedWriter` lays out every output shard in advance (the tensor shapes are known before any is
computed), writes the headers, then writes each tensor (or piece) at its offset as soon as it is ready, from any
thread and in any order: nothing is buffered beyond the tensor being written.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Collection
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import torch

from alloy.errors import AlloyError, ErrorCode
from alloy.model_manifest import ModelManifest

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
MAX_IO = 1 << 30  # bytes per pread/pwrite call (Linux caps one call just under 2 GiB)


def _read_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done : done + MAX_IO]], offset + done)
        if count <= 0:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, "safetensors file is truncated")
        done += count


def _write_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + MAX_IO], offset + done)


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsReader:
    """Random access to the tensors of one model folder (single file or sharded with an index)."""

    def __init__(self, model_dir: Path, manifest: ModelManifest):
        self.model_dir = Path(model_dir)
        self._index([self.model_dir / shard for shard in manifest.shards])

    @classmethod
    def from_files(cls, paths: list[Path]) -> SafetensorsReader:
        """A reader of loose safetensors files (a LoRA adapter's weights), with no model manifest."""
        reader = cls.__new__(cls)
        reader.model_dir = Path(paths[0]).parent
        reader._index(paths)
        return reader

    def _index(self, paths: list[Path]) -> None:
        self.tensors: dict[str, StoredTensor] = {}
        for path in paths:
            with path.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            header.pop("__metadata__", None)
            for name, info in header.items():
                begin, end = info["data_offsets"]
                self.tensors[name] = StoredTensor(
                    path, info["dtype"], tuple(info["shape"]), 8 + length + begin, end - begin
                )
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def read(self, name: str) -> torch.Tensor:
        stored = self.tensors[name]
        dtype = TORCH_DTYPES.get(stored.dtype)
        if dtype is None:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, f"tensor {name!r} has unsupported dtype {stored.dtype}")
        buffer = torch.empty(stored.nbytes, dtype=torch.uint8)
        if stored.nbytes:
            _read_exact(self._fd(stored.file), buffer.numpy().data, stored.start)
        return buffer.view(dtype).reshape(stored.shape)

    def read_range(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements ``[start, start + count)`` of the tensor in storage (row-major) order, as a flat tensor: a
        piece of a large tensor without the rest of it in memory."""
        stored = self.tensors[name]
        dtype = TORCH_DTYPES.get(stored.dtype)
        if dtype is None:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, f"tensor {name!r} has unsupported dtype {stored.dtype}")
        size = dtype.itemsize
        if start < 0 or count < 0 or (start + count) * size > stored.nbytes:
            raise ValueError(f"{name}: elements [{start}, {start + count}) lie outside the tensor")
        buffer = torch.empty(count * size, dtype=torch.uint8)
        if count:
            _read_exact(self._fd(stored.file), buffer.numpy().data, stored.start + start * size)
        return buffer.view(dtype)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


@dataclass(frozen=True)
class _Slot:
    file: Path
    start: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def index_text(weight_map: dict[str, str], total_bytes: int) -> str:
    """``model.safetensors.index.json`` of a sharded folder (tensor name -> shard file)."""
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(index, indent=2) + "\n"


def shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def split_into_shards(tensors: list[PlannedTensor], shard_bytes: int) -> list[list[PlannedTensor]]:
    """Greedy, in order: a shard is closed when the next tensor would take it past ``shard_bytes``
    (a tensor larger than that gets a shard of its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


class ShardedWriter:
    """Writes planned tensors into preallocated shards plus ``model.safetensors.index.json``; with ``only``, just
    the shards with those numbers (from 1) of the same layout (one group of a fanned-out merge)."""

    def __init__(
        self,
        out_dir: Path,
        tensors: list[PlannedTensor],
        shard_bytes: int,
        metadata: dict[str, str] | None = None,
        only: Collection[int] | None = None,
    ):
        self.out_dir = Path(out_dir)
        self.slots: dict[str, _Slot] = {}
        self.weight_map: dict[str, str] = {}
        self._fds: list[int] = []
        self._fd_by_path: dict[Path, int] = {}
        shards = split_into_shards(tensors, shard_bytes)
        chosen = [(n, members) for n, members in enumerate(shards, start=1) if only is None or n in only]
        self.total_bytes = sum(t.nbytes for _, members in chosen for t in members)
        for number, members in chosen:
            self._open_shard(shard_name(number, len(shards)), members, metadata or {})

    def _open_shard(self, file_name: str, members: list[PlannedTensor], metadata: dict[str, str]) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt", **metadata}}
        offset = 0
        for tensor in members:
            header[tensor.name] = {
                "dtype": SAFETENSORS_DTYPES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + tensor.nbytes],
            }
            offset += tensor.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the format aligns the data section to 8 bytes
        path = self.out_dir / file_name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fds.append(fd)
        os.pwrite(fd, struct.pack("<Q", len(encoded)) + encoded, 0)
        data_start = 8 + len(encoded)
        os.ftruncate(fd, data_start + offset)
        for tensor in members:
            begin = header[tensor.name]["data_offsets"][0]  # type: ignore[index]
            self.slots[tensor.name] = _Slot(path, data_start + begin, tensor.nbytes, tensor.dtype, tensor.shape)
            self.weight_map[tensor.name] = file_name
        self._fd_by_path[path] = fd

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Write one tensor (any thread); returns its byte count."""
        slot = self.slots[name]
        if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
            raise ValueError(f"{name}: planned {slot.dtype}{list(slot.shape)}, got {tensor.dtype}{list(tensor.shape)}")
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if slot.nbytes:
            _write_exact(self._fd_by_path[slot.file], flat.numpy().data, slot.start)
        return slot.nbytes

    def write_range(self, name: str, start: int, piece: torch.Tensor) -> int:
        """Write ``piece`` as elements ``[start, start + piece.numel())`` of a planned tensor (any thread); returns
        its byte count. The pieces of a tensor written this way are the bytes :meth:`write` writes for the whole."""
        slot = self.slots[name]
        if piece.dtype != slot.dtype:
            raise ValueError(f"{name}: planned {slot.dtype}, got a piece of {piece.dtype}")
        flat = piece.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        offset = start * slot.dtype.itemsize
        if start < 0 or offset + flat.numel() > slot.nbytes:
            raise ValueError(f"{name}: a piece at element {start} runs past the tensor")
        if flat.numel():
            _write_exact(self._fd_by_path[slot.file], flat.numpy().data, slot.start + offset)
        return flat.numel()

    def write_split(self, name: str, tensor: torch.Tensor, pool: Executor, parts: int) -> int:
        """:meth:`write` as ``parts`` pieces written at once on ``pool``'s threads (the same bytes at the same
        offsets: a system call holds no GIL, so the pieces' writes overlap); returns the byte count."""
        slot = self.slots[name]
        if parts < 2 or tensor.device.type != "cpu" or tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
            return self.write(name, tensor)  # in one piece: a GPU tensor, or the planned-versus-got error
        flat = tensor.detach().contiguous().view(-1)
        step = max(1, -(-flat.numel() // parts))
        starts = range(0, flat.numel(), step)
        return sum(pool.map(lambda start: self.write_range(name, start, flat[start : start + step]), starts))

    def finish(self, index: bool = True) -> None:
        """Flush the shards to disk and write the index (unless ``index`` is False)."""
        for fd in self._fds:
            os.fsync(fd)
        self.close()
        if index:
            (self.out_dir / INDEX_FILE).write_text(index_text(self.weight_map, self.total_bytes))

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
