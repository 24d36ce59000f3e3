"""Load a model folder for evaluation (fp32, eval mode, safetensors only) and load candidate weights into it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from alloy.errors import validation_failed
from alloy.model_manifest import weight_files

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


def load_model(model_dir: str | Path) -> LoadedModel:
    # lazy: transformers costs seconds to import; only model loading needs it
    from transformers import AutoModel, AutoModelForCausalLM

    model_dir = Path(model_dir)
    weight_files(model_dir)  # refuses pickle-only folders before transformers could look at them
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
