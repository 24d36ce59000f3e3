"""Load a model folder for evaluation (fp32, eval mode, safetensors only) and load candidate weights into it.

A folder whose weights cannot be read fails with the error a merge gives for it (VALIDATION_FAILED naming the
model and the damaged file, :func:`alloy.storage.integrity.damaged_model`), never with the library's text."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from alloy.errors import AlloyError, ErrorCode, validation_failed
from alloy.model_manifest import weight_files
from alloy.storage.integrity import Damage, damaged_model, safetensors_problem
from kernels.params import layer_index

log = logging.getLogger(__name__)

ModelKind = Literal["encoder", "causal_lm"]
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    kind: ModelKind
    path: Path


def model_kind(model_dir: Path) -> ModelKind:
    config = json.loads((model_dir / "config.json").read_text())
    architectures = config.get("architectures") or []
    return "causal_lm" if any(a.endswith(_CAUSAL_SUFFIXES) for a in architectures) else "encoder"


def load_tokenizer(model_dir: Path):
    # lazy: transformers costs seconds to import; only model loading needs it
    from transformers import AutoTokenizer

    if not any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        raise validation_failed("the model folder has no tokenizer files; evaluation needs them", path=str(model_dir))
    return AutoTokenizer.from_pretrained(str(model_dir))


def load_model(model_dir: str | Path, model_id: str | None = None) -> LoadedModel:
    """``model_id`` names the model in errors (default: the folder's name)."""
    model_dir = Path(model_dir)
    shards = weight_files(model_dir)  # refuses pickle-only folders before transformers could look at them
    try:
        return _load(model_dir)
    except AlloyError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers and safetensors raise many types
        raise _unreadable(model_dir, shards, model_id or model_dir.name, exc) from None


def _unreadable(model_dir: Path, shards: list[str], model_id: str, exc: Exception) -> AlloyError:
    """The error of a folder transformers could not load: the damaged shard when one is (truncated, bad header)."""
    log.warning("loading model %s from %s failed", model_id, model_dir, exc_info=exc)
    for shard in shards:
        problem = safetensors_problem(model_dir / shard)
        if problem is not None:
            return damaged_model(model_id, Damage(file=shard, reason=problem))
    return AlloyError(
        ErrorCode.VALIDATION_FAILED,
        f"model {model_id!r} cannot be loaded for evaluation ({type(exc).__name__})",
        {"model_id": model_id},
    )


def _load(model_dir: Path) -> LoadedModel:
    # lazy: transformers costs seconds to import; only model loading needs it
    from transformers import AutoModel, AutoModelForCausalLM

    kind = model_kind(model_dir)
    common = {"dtype": torch.float32, "use_safetensors": True}
    if kind == "causal_lm":
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), **common)
    else:
        try:  # sentence encoders are scored on hidden states; a pooler would only add unused random weights
            model = AutoModel.from_pretrained(str(model_dir), add_pooling_layer=False, **common)
        except TypeError:
            model = AutoModel.from_pretrained(str(model_dir), **common)
    model.eval()
    return LoadedModel(model=model, tokenizer=load_tokenizer(model_dir), kind=kind, path=model_dir)


def tied_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names that share storage with an earlier parameter (e.g. a tied ``lm_head.weight``); checkpoints omit them."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = tensor.data_ptr()
        if key in seen:
            tied.add(name)
        else:
            seen[key] = name
    return tied


def fit_layer_stack(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Give the skeleton as many transformer blocks as ``state_dict`` has: a layer-stacking (franken, data-flow)
    candidate may be shallower or deeper than the model it is scored in. Blocks are dropped from the end or
    copied from the last one (their weights come from ``state_dict`` right after), renumbered for the KV cache,
    and the config's depth follows. A skeleton without a recognisable block list is left as it is (the strict
    load then names the mismatch)."""
    config: Any = getattr(model, "config", None)
    depth = getattr(config, "num_hidden_layers", None)
    indices = {index for name in state_dict if (index := layer_index(name)) is not None}
    if not isinstance(depth, int) or not indices or max(indices) + 1 == depth:
        return
    wanted = max(indices) + 1
    stack = _block_list(model, depth)
    if stack is None:
        return
    layer_types = getattr(config, "layer_types", None)
    if layer_types and len(set(layer_types)) > 1:
        raise validation_failed(
            "a candidate of another depth cannot be scored in a skeleton whose layers are of several types",
            depth=wanted,
        )
    if wanted < depth:
        del stack[wanted:]
    else:
        stack.extend(copy.deepcopy(stack[-1]) for _ in range(wanted - depth))
    for index, block in enumerate(stack):
        for module in block.modules():
            if hasattr(module, "layer_idx"):
                setattr(module, "layer_idx", index)  # noqa: B010  (mypy sees a Module attribute as a Tensor)
    config.num_hidden_layers = wanted
    if layer_types:
        config.layer_types = [layer_types[0]] * wanted


def _block_list(model: torch.nn.Module, depth: int) -> torch.nn.ModuleList | None:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == depth and name.split(".")[-1] in _BLOCKS:
            return module
    return None


_BLOCKS = ("layers", "layer", "h", "blocks", "block")


def load_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], tied: set[str]) -> None:
    """Strict load, except that tied parameters may be absent (their twin carries the value)."""
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [name for name in missing if name not in tied]
    if missing or unexpected:
        raise validation_failed(
            "candidate weights do not match the model skeleton",
            missing=missing[:10],
            unexpected=list(unexpected)[:10],
        )
