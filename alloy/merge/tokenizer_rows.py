"""Which rows of which input make each row of a vocabulary tensor (embeddings, LM head) once the output vocabulary
is built: the :class:`kernels.vocabulary.VocabularyAlignment` of one output tensor, decided from vocabularies and
shapes only, before any tensor is read (so every refusal comes before the merge writes anything).

As in mergekit 0.1.5, for the inputs of the tensor (its slice's sources) and the slice's base:

* a token every input has keeps each input's own row (unless a ``tokens:`` entry forces its source);
* a token only some inputs have takes, in the inputs lacking it, a fill: the row of the one input that has it,
  else the base's row when the base is an input and has it, else the average of the inputs that have it; a token
  no input has is zeros;
* a ``tokens:`` entry fills the token from its source: a model's row of that token, ``{kind: model_token}`` (a
  token or token id of a model's own vocabulary) or ``{kind: zero}``; with ``force`` every input takes it;
* rows past the vocabulary (``pad_to_multiple_of``) are each input's mean token row.

Only the tensors named in :data:`VOCABULARY_TENSORS` (outside the layer stack) are aligned, on their first axis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.tokenizer import OutputVocabulary
from alloy.merge.tokenizer_config import ModelToken, TokenizerSettings, TokenSetting, ZeroRow
from kernels.params import layer_index
from kernels.vocabulary import VocabularyAlignment

# Token-indexed tensors (vocabulary on the first axis) of the architectures mergekit 0.1.5 knows: input embeddings
# and output heads, by the end of their name.
VOCABULARY_TENSORS = (
    "embed_tokens.weight",
    "tok_embeddings.weight",
    "wte.weight",
    "word_embeddings.weight",
    "embed_in.weight",
    "embed_out.weight",
    "shared.weight",
    "backbone.embeddings.weight",
    "lm_head.weight",
    "lm_head.bias",
    "lm_head.decoder.weight",
    "lm_head.linear.weight",
    "lm_head.linear.bias",
    "output.weight",
    "output_layer.weight",
    "cls.predictions.decoder.weight",
    "cls.predictions.bias",
    "vocab_projector.weight",
    "vocab_projector.bias",
)


def is_vocabulary_tensor(name: str) -> bool:
    if layer_index(name) is not None:
        return False
    return any(name == suffix or name.endswith("." + suffix) for suffix in VOCABULARY_TENSORS)


def _refuse(token: str, message: str, **details: Any) -> AlloyError:
    return AlloyError(
        ErrorCode.VALIDATION_FAILED,
        f"tokenizer.tokens.{token}: {message}",
        {"field": f"tokenizer.tokens.{token}", "token": token, **details},
    )


class RowPlanner:
    """The alignments of one merge's vocabulary tensors (one per set of inputs and base, computed once)."""

    def __init__(self, vocabulary: OutputVocabulary, settings: TokenizerSettings, mergekit_order: Sequence[str]):
        self.vocabulary = vocabulary
        self.settings = settings
        self.order = {model: i for i, model in enumerate(mergekit_order)}  # mergekit's input order (averages)
        self._cache: dict[tuple, VocabularyAlignment] = {}

    @property
    def rows(self) -> int:
        return self.vocabulary.rows

    def covers(self, name: str) -> bool:
        return is_vocabulary_tensor(name)

    def alignment(
        self, models: Sequence[str], base: str | None, rows_by_model: Mapping[str, int]
    ) -> VocabularyAlignment:
        key = (tuple(models), base, tuple(sorted(rows_by_model.items())))
        if key not in self._cache:
            self._cache[key] = self._build(list(models), base, rows_by_model)
        return self._cache[key]

    def _position(self, model: str) -> int:
        return self.order.get(model, len(self.order))

    def _build(self, models: list[str], base: str | None, rows_by_model: Mapping[str, int]) -> VocabularyAlignment:
        vocab = self.vocabulary
        own: list[list[int]] = [[-1] * len(vocab.vocab) for _ in models]
        fill_rows: list[int] = []
        fill_sources: list[tuple[tuple[int, int], ...]] = []
        averaging = sorted(range(len(models)), key=lambda p: self._position(models[p]))
        for token, row in sorted(vocab.vocab.items(), key=lambda item: item[1]):
            if row >= vocab.rows:
                raise AlloyError(
                    ErrorCode.VALIDATION_FAILED,
                    f"the output tokenizer gives {token!r} id {row}, past its {vocab.rows} rows",
                    {"field": "tokenizer", "token": token},
                )
            ids = [self._token_id(model, token) for model in models]
            setting = self.settings.tokens.get(token)
            force = bool(setting and setting.force)
            for p, index in enumerate(ids):
                if index >= 0 and not force:
                    own[p][row] = index
            if not force and all(index >= 0 for index in ids):
                continue
            sources = self._fill(token, setting, models, base, ids, averaging, rows_by_model)
            if sources is not None:
                fill_rows.append(row)
                fill_sources.append(sources)
        return VocabularyAlignment(
            rows=vocab.rows,
            used=len(vocab.vocab),
            own=tuple(tuple(rows) for rows in own),
            fill_rows=tuple(fill_rows),
            fill_sources=tuple(fill_sources),
        )

    def _token_id(self, model: str, token: str) -> int:
        ids = self.vocabulary.token_ids[model]
        if token in ids:
            return ids[token]
        beyond = self.vocabulary.beyond[model].get(token)
        if beyond is not None:  # mergekit 0.1.5 fails on such a token too (a missing permutation entry)
            raise AlloyError(
                ErrorCode.VALIDATION_FAILED,
                f"{model!r}'s tokenizer gives {token!r} id {beyond}, past the model's vocab_size: the model has no "
                "row for a token of the output vocabulary",
                {"field": "tokenizer", "model": model, "token": token},
            )
        return -1

    def _fill(
        self,
        token: str,
        setting: TokenSetting | None,
        models: list[str],
        base: str | None,
        ids: list[int],
        averaging: list[int],
        rows_by_model: Mapping[str, int],
    ) -> tuple[tuple[int, int], ...] | None:
        if setting is None:  # mergekit's automatic choice
            having = [p for p, index in enumerate(ids) if index >= 0]
            if len(having) == 1:
                return ((having[0], ids[having[0]]),)
            if not having:
                return ()
            if base in models and ids[models.index(base)] >= 0:
                p = models.index(base)
                return ((p, ids[p]),)
            return tuple((p, ids[p]) for p in averaging if ids[p] >= 0)
        source = setting.source
        if isinstance(source, ZeroRow):
            return ()
        if source is None:
            raise _refuse(token, "needs a source here (a model, {kind: model_token, ...} or {kind: zero})")
        model = source.model if isinstance(source, ModelToken) else source
        if model not in models:
            raise _refuse(
                token,
                f"takes its row from {model!r}, which is not an input of this tensor ({', '.join(models)})",
                model=model,
            )
        p = models.index(model)
        if isinstance(source, ModelToken):
            index = source.token_id
            if index is None:
                original = self.vocabulary.original.get(model, {})
                if source.token not in original:
                    raise _refuse(token, f"{source.token!r} is not in {model!r}'s tokenizer", model=model)
                index = original[source.token]
            if not 0 <= index < rows_by_model[model]:
                raise _refuse(token, f"token id {index} is out of {model!r}'s {rows_by_model[model]} rows", model=model)
            return ((p, index),)
        if ids[p] < 0:
            raise _refuse(token, f"{model!r} does not have this token", model=model)
        return ((p, ids[p]),)
