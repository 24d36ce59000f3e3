"""``merge.device: cuda`` is the CPU code path with the tensors moved: on a machine without CUDA, a stand-in
device that is the CPU under the name ``cuda`` runs the very same executor and kernels, and must give the CPU
merge's bits while every kernel input went through the device move and every output came back. Without CUDA (and
without the stand-in) the request is refused with GPU_UNAVAILABLE, never a crash."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.executor import execute_merge
from alloy.merge.recipe import MergeRecipe, ModelRef


def ties_recipe() -> MergeRecipe:
    return MergeRecipe(
        strategy="ties",
        models=[ModelRef(model=m) for m in ("base", "t1", "t2")],
        base_model="base",
        parameters={"density": 0.5},
    )


@pytest.fixture
def family(tiny_family):
    base, tunes = tiny_family
    return {"base": base, "t1": tunes[0], "t2": tunes[1]}


@pytest.fixture
def cuda_on_the_cpu(monkeypatch):
    """``cuda`` resolves and every ``Tensor.to`` towards it lands on the CPU; the moves are counted."""
    moves = {"to_cuda": 0}
    real_to = torch.Tensor.to

    def is_cuda(target) -> bool:
        return isinstance(target, str | torch.device) and str(target).startswith("cuda")

    def to(self, *args, **kwargs):
        if args and is_cuda(args[0]):
            moves["to_cuda"] += 1
            args = ("cpu", *args[1:])
        if is_cuda(kwargs.get("device")):
            moves["to_cuda"] += 1
            kwargs["device"] = "cpu"
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return moves


def weights(folder) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        found.update(load_file(shard))
    return found


def test_the_cuda_path_gives_the_cpu_bits(family, tmp_path, cuda_on_the_cpu):
    execute_merge(ties_recipe(), family, tmp_path / "cpu", device="cpu")
    assert cuda_on_the_cpu["to_cuda"] == 0
    result = execute_merge(ties_recipe(), family, tmp_path / "cuda", device="cuda")
    assert cuda_on_the_cpu["to_cuda"] >= 3 * result.tensors  # every input of every tensor was moved
    cpu, cuda = weights(tmp_path / "cpu"), weights(tmp_path / "cuda")
    assert cpu.keys() == cuda.keys()
    assert all(torch.equal(cpu[name], cuda[name]) for name in cpu)


def test_cuda_without_a_gpu_is_gpu_unavailable(family, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(AlloyError) as caught:
        execute_merge(ties_recipe(), family, tmp_path / "out", device="cuda")
    assert caught.value.code == ErrorCode.GPU_UNAVAILABLE
    assert not (tmp_path / "out").exists()
