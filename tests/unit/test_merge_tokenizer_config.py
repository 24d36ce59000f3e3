"""The tokenizer keys of a mergekit recipe (tokenizer_source, tokenizer:, chat_template): parsed as mergekit 0.1.5
reads them, refused by field name where mergekit refuses them or Alloy cannot reproduce them; chat templates
resolved (names, auto, Jinja strings); the merged folder's tokenizer on a real (tiny) merge."""

from __future__ import annotations

import pytest

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.chat_templates import CHATML, resolve_chat_template
from alloy.merge.mergekit import load_recipe_yaml
from alloy.merge.tokenizer_config import ModelToken, ZeroRow

HEAD = (
    "merge_method: linear\nmodels:\n  - {model: a, parameters: {weight: 1}}\n  - {model: b, parameters: {weight: 1}}\n"
)
JINJA = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_tokenizer_source_and_chat_template_are_read():
    recipe = load_recipe_yaml(HEAD + "tokenizer_source: union\nchat_template: chatml\n")
    assert recipe.tokenizer is not None
    assert recipe.tokenizer.source == "union" and recipe.tokenizer.chat_template == "chatml"
    assert recipe.tokenizer.builds_vocabulary and recipe.tokenizer.source_model is None
    only_template = load_recipe_yaml(HEAD + "chat_template: auto\n").tokenizer
    assert only_template is not None and not only_template.builds_vocabulary
    assert load_recipe_yaml(HEAD).tokenizer is None
    assert load_recipe_yaml(HEAD + "tokenizer_source: b\n").tokenizer.models_named() == ["b"]


def test_the_tokenizer_block_defaults_to_union_and_reads_token_sources():
    text = HEAD + (
        "tokenizer:\n  pad_to_multiple_of: 8\n  tokens:\n    x: {source: a, force: true}\n"
        "    y: {source: {kind: zero}}\n    z: {source: {kind: model_token, model: b, token_id: 3}}\n"
    )
    settings = load_recipe_yaml(text).tokenizer
    assert settings.source == "union" and settings.pad_to_multiple_of == 8
    assert settings.tokens["x"].source == "a" and settings.tokens["x"].force
    assert isinstance(settings.tokens["y"].source, ZeroRow) and not settings.tokens["y"].force
    assert isinstance(settings.tokens["z"].source, ModelToken) and settings.tokens["z"].source.token_id == 3
    assert settings.models_named() == ["a", "b"]
    assert [settings.padded(n) for n in (8, 9, 16)] == [8, 16, 16]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ("tokenizer_source: union\ntokenizer: {source: base}\n", "tokenizer"),
        ("tokenizer: {source: base, merge: true}\n", "tokenizer.merge"),
        ("tokenizer: {pad_to_multiple_of: -8}\n", "tokenizer.pad_to_multiple_of"),
        ("tokenizer: {tokens: {x: {source: {kind: model_token, model: a}}}}\n", "tokenizer.tokens.x.source"),
        ("tokenizer: {tokens: {x: {source: a, sticky: true}}}\n", "tokenizer.tokens.x.sticky"),
        ("tokenizer_source: 3\n", "tokenizer_source"),
        ("tokenizer_source: a+b+c\n", "tokenizer_source"),
        ("chat_template: [1]\n", "chat_template"),
    ],
)
def test_malformed_tokenizer_settings_are_refused_by_field(extra, field):
    with pytest.raises(AlloyError) as info:
        load_recipe_yaml(HEAD + extra)
    assert info.value.code == ErrorCode.VALIDATION_FAILED and info.value.details["field"] == field


@pytest.mark.parametrize("value", ["alpaca", "exaone", "nosuchtemplate", "{{ short }}"])
def test_templates_alloy_cannot_reproduce_or_mergekit_refuses_are_refused(value):
    with pytest.raises(AlloyError) as info:
        resolve_chat_template(value, [])
    assert info.value.details["field"] == "chat_template"


def test_chat_templates_resolve_like_mergekit():
    assert resolve_chat_template("chatml", []) == CHATML
    assert resolve_chat_template(JINJA, []) == JINJA
    assert resolve_chat_template("auto", [None, {"default": " T1 "}, "T2", "T1"]) == "T1"  # plurality, stripped
    assert resolve_chat_template("auto", ["T2", "T1"]) == "T2"  # a tie: the first in recipe order
    assert resolve_chat_template("auto", [None, ""]) is None


def test_vocabulary_tensors_may_differ_in_rows_only_with_a_vocabulary_to_align_to():
    import torch

    from alloy.merge.compatibility import check_layouts
    from alloy.merge.plan import TensorMeta

    def layout(rows: int, width: int = 4):
        return {
            "model.embed_tokens.weight": TensorMeta((rows, width), torch.float32),
            "model.norm.weight": TensorMeta((width,), torch.float32),
        }

    with pytest.raises(AlloyError) as info:
        check_layouts(load_recipe_yaml(HEAD), {"a": layout(5), "b": layout(6)})
    assert info.value.code == ErrorCode.INCOMPATIBLE_MODELS and "tokenizer_source" in info.value.message
    aligned = load_recipe_yaml(HEAD + "tokenizer_source: union\n")
    check_layouts(aligned, {"a": layout(5), "b": layout(6)})
    with pytest.raises(AlloyError) as info:  # other dimensions must still match
        check_layouts(aligned, {"a": layout(5), "b": layout(6, width=8)})
    assert info.value.code == ErrorCode.INCOMPATIBLE_MODELS


def test_alloy_recipes_take_no_tokenizer_settings():
    with pytest.raises(AlloyError) as info:
        load_recipe_yaml("strategy: ties\nmodels: [a, b]\ntokenizer: {source: union}\n")
    assert info.value.details["field"] == "tokenizer"
