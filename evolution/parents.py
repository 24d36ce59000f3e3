"""Parent weights, loaded once in the driver and shared with every trial through Ray's object store.

Why numpy: Ray serialises numpy arrays out-of-band, so ``ray.get`` on a worker maps them straight from the
node's shared-memory object store without a copy; every trial on a node reads the same bytes. ``torch.from_numpy``
then wraps them, again without a copy. The arrays are read-only, so merges must never write into their inputs
(Alloy's kernels do not).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch loads only in processes that handle tensors
    import torch

ParentArrays = dict[str, dict[str, np.ndarray]]


def load_state_dict_arrays(model_dir: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors model folder as fp32 numpy (the dtype merges compute in)."""
    # lazy: torch loads only in processes that handle tensors
    import torch
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    arrays: dict[str, np.ndarray] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            arrays[name] = tensor.to(torch.float32).contiguous().numpy()
    return arrays


def load_parents(model_dirs: dict[str, Path]) -> ParentArrays:
    return {model_id: load_state_dict_arrays(path) for model_id, path in model_dirs.items()}


def as_tensors(parents: ParentArrays) -> dict[str, dict[str, torch.Tensor]]:
    """Zero-copy torch views of the shared arrays."""
    # lazy: torch loads only in processes that handle tensors
    import torch

    with warnings.catch_warnings():
        # The arrays are read-only (they live in the object store); torch warns that writes would be undefined.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return {
            model_id: {name: torch.from_numpy(array) for name, array in tensors.items()}
            for model_id, tensors in parents.items()
        }


def parent_bytes(parents: ParentArrays) -> int:
    return sum(array.nbytes for tensors in parents.values() for array in tensors.values())
