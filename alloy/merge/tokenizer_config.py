"""The tokenizer part of a recipe, as mergekit 0.1.5 reads it: ``tokenizer_source``, the ``tokenizer:`` block and
``chat_template``.

* ``tokenizer_source: base | union | <model>`` builds the output vocabulary (see :mod:`alloy.merge.tokenizer`) and
  aligns the embedding rows of every model to it before the method sees them.
* ``tokenizer: {source, tokens, pad_to_multiple_of}`` does the same (``source`` defaults to ``union``, as in
  mergekit); ``tokens`` names per-token embedding sources (a model, ``{kind: model_token, model, token | token_id}``
  or ``{kind: zero}``) and ``force`` applies the source even where a model has its own row; every named token
  joins the vocabulary. ``pad_to_multiple_of`` pads the embedding rows (and ``vocab_size``).
* ``chat_template``: a known template name, ``auto`` (the template most input models share) or a Jinja string.

The two first forms are exclusive (mergekit refuses both at once). Every key is checked by name here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from alloy.errors import AlloyError, ErrorCode

UNION = "union"
BASE = "base"


class ModelToken(BaseModel):
    """The row of ``token`` (or of id ``token_id``) in ``model``'s own embedding."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["model_token"]
    model: str = Field(min_length=1)
    token_id: int | None = None
    token: str | None = None

    @model_validator(mode="after")
    def _one_of(self) -> ModelToken:
        if (self.token_id is None) == (self.token is None):
            raise ValueError("give exactly one of token_id or token")
        return self


class ZeroRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["zero"]


class TokenSetting(BaseModel):
    """Where one token's row comes from: a model (its row of that token), a model's token, or zeros; ``force``
    uses it for every model, not only those lacking the token."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: ModelToken | ZeroRow | str | None = None
    force: bool = False


class TokenizerSettings(BaseModel):
    """``source``: ``base``, ``union``, a model, or None (no vocabulary built: the base's tokenizer files, with
    ``chat_template`` applied when set)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str | None = None
    tokens: dict[str, TokenSetting] = Field(default_factory=dict)
    pad_to_multiple_of: int | None = None
    chat_template: str | None = None

    @property
    def builds_vocabulary(self) -> bool:
        return self.source is not None

    @property
    def source_model(self) -> str | None:
        """The model whose tokenizer the output takes (``tokenizer_source: <model>``), else None."""
        return self.source if self.source not in (None, UNION, BASE) else None

    def models_named(self) -> list[str]:
        """Models the settings name besides the merge's inputs may (the source) or must (token sources) be."""
        named = [self.source_model] if self.source_model else []
        for setting in self.tokens.values():
            source = setting.source
            model = source.model if isinstance(source, ModelToken) else source
            if isinstance(model, str) and model not in named:
                named.append(model)
        return named

    def padded(self, size: int) -> int:
        """``size`` rounded up to ``pad_to_multiple_of`` (mergekit pads when it is set and does not divide)."""
        step = self.pad_to_multiple_of
        if step and size % step:
            return size + step - size % step
        return size


def _refuse(field: str, message: str) -> AlloyError:
    return AlloyError(ErrorCode.VALIDATION_FAILED, f"{field}: {message}", {"field": field})


def _model_name(value: Any, field: str) -> str:
    from alloy.merge.lora import split_reference

    if not isinstance(value, str) or not value:
        raise _refuse(field, f"must be 'base', 'union' or a model name or path, got {type(value).__name__}")
    try:
        split_reference(value)
    except AlloyError as exc:
        raise _refuse(field, exc.message) from None
    return value


def settings_from_mergekit(data: dict[str, Any]) -> TokenizerSettings | None:
    """The tokenizer settings of a mergekit recipe (its top-level mapping), or None when it has none."""
    source = data.get("tokenizer_source")
    block = data.get("tokenizer")
    template = data.get("chat_template")
    if source is not None and block is not None:
        raise _refuse("tokenizer", "give either tokenizer_source or a tokenizer: block, not both")
    if template is not None:
        if not isinstance(template, str):
            raise _refuse("chat_template", "must be a template name, 'auto' or a Jinja string")
        from alloy.merge.chat_templates import check_chat_template

        check_chat_template(template)
    if source is None and block is None and template is None:
        return None
    fields: dict[str, Any] = {"chat_template": template or None}
    if source is not None:
        fields["source"] = _model_name(source, "tokenizer_source")
    if block is not None:
        fields.update(_block(block))
    try:
        return TokenizerSettings(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise _refuse("tokenizer." + ".".join(map(str, first["loc"])), first["msg"]) from None


def _block(block: Any) -> dict[str, Any]:
    if not isinstance(block, dict):
        raise _refuse("tokenizer", "must be a mapping (source, tokens, pad_to_multiple_of)")
    known = {"source", "tokens", "pad_to_multiple_of"}
    for key in block:
        if key not in known:
            raise _refuse(f"tokenizer.{key}", f"unknown key (known: {', '.join(sorted(known))})")
    fields: dict[str, Any] = {"source": _model_name(block.get("source", UNION), "tokenizer.source")}
    pad = block.get("pad_to_multiple_of")
    if pad is not None:
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
            raise _refuse("tokenizer.pad_to_multiple_of", f"must be a non-negative integer, got {pad!r}")
        fields["pad_to_multiple_of"] = pad
    tokens = block.get("tokens")
    if tokens is not None:
        if not isinstance(tokens, dict):
            raise _refuse("tokenizer.tokens", "must map each token to {source, force}")
        fields["tokens"] = {
            str(token): _token(setting, f"tokenizer.tokens.{token}") for token, setting in tokens.items()
        }
    return fields


def _token(setting: Any, field: str) -> TokenSetting:
    if setting is None:
        setting = {}
    if not isinstance(setting, dict):
        raise _refuse(field, "must be a mapping {source, force}")
    source = setting.get("source")
    if isinstance(source, str):
        _model_name(source, f"{field}.source")
    try:
        return TokenSetting.model_validate(setting)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(
            str(p) for p in first["loc"] if "[" not in str(p) and str(p) not in ("ModelToken", "ZeroRow", "str")
        )
        raise _refuse(f"{field}.{where}" if where else field, first["msg"]) from None
