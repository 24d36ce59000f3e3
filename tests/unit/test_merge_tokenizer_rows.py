"""Row alignment of vocabulary tensors, hand-computed on tiny tensors: which row each input contributes, the fills
(donor, base, average, zeros, forced and model-token sources), padding rows, and the refusals that come before
any tensor is read."""

from __future__ import annotations

import pytest
import torch

from alloy.errors import AlloyError
from alloy.merge.tokenizer import OutputVocabulary
from alloy.merge.tokenizer_config import TokenizerSettings
from alloy.merge.tokenizer_rows import RowPlanner, is_vocabulary_tensor
from kernels.errors import KernelError
from kernels.vocabulary import VocabularyAlignment, align_vocabulary

# Output vocabulary: a b c d (ids 0..3). Model "x" has a, b, c at rows 2, 0, 1; model "y" has b, d at rows 0, 1
# and c at row 5, past its vocab_size (so it is "beyond"); model "z" has a, b, c, d at rows 0..3.
VOCAB = {"a": 0, "b": 1, "c": 2, "d": 3}
IDS = {"x": {"a": 2, "b": 0, "c": 1}, "y": {"b": 0, "d": 1}, "z": {"a": 0, "b": 1, "c": 2, "d": 3}}
X = torch.tensor([[10.0, 11.0], [20.0, 21.0], [30.0, 31.0]])  # rows: b, c, a
Y = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # rows: b, d
Z = torch.tensor([[100.0, 0.0], [200.0, 0.0], [300.0, 0.0], [400.0, 0.0]])  # a b c d


def planner(tokens=None, pad=None, ids=IDS, beyond=None, order=()) -> RowPlanner:
    settings = TokenizerSettings.model_validate({"source": "union", "tokens": tokens or {}, "pad_to_multiple_of": pad})
    vocabulary = OutputVocabulary(
        tokenizer=None,
        vocab=dict(VOCAB),
        rows=settings.padded(len(VOCAB)),
        token_ids={m: dict(v) for m, v in ids.items()},
        beyond={m: dict((beyond or {}).get(m, {})) for m in ids},
        original={"x": {"a": 2, "b": 0, "c": 1}, "y": {"b": 0, "d": 1, "c": 5}, "z": dict(IDS["z"])},
    )
    return RowPlanner(vocabulary, settings, order)


def aligned(plan: RowPlanner, models, base, tensors):
    alignment = plan.alignment(models, base, {m: t.shape[0] for m, t in zip(models, tensors)})
    return alignment, align_vocabulary(list(tensors), alignment)


def test_own_rows_then_donor_and_average_fills():
    alignment, (x, y) = aligned(planner(), ["x", "y"], None, [X, Y])
    assert alignment.own == ((2, 0, 1, -1), (-1, 0, -1, 1))
    # a: only x has it (donor x); b: both; c: only x; d: only y (donor y)
    torch.testing.assert_close(x, torch.tensor([[30.0, 31.0], [10.0, 11.0], [20.0, 21.0], [3.0, 4.0]]))
    torch.testing.assert_close(y, torch.tensor([[30.0, 31.0], [1.0, 2.0], [20.0, 21.0], [3.0, 4.0]]))


def test_a_token_several_inputs_have_comes_from_the_base_else_their_average():
    # d: y and z have it, x lacks it
    _, (x, _, _) = aligned(planner(), ["x", "y", "z"], "z", [X, Y, Z])
    torch.testing.assert_close(x[3], torch.tensor([400.0, 0.0]))  # the base z's row
    _, (x, _, _) = aligned(planner(), ["x", "y", "z"], None, [X, Y, Z])
    torch.testing.assert_close(x[3], torch.tensor([(3.0 + 400.0) / 2, 4.0 / 2]))  # no base: the average


def test_averages_add_in_mergekits_input_order():
    alignment = planner(order=["z", "y", "x"]).alignment(["x", "y", "z"], None, {"x": 3, "y": 2, "z": 4})
    row_of_d = alignment.fill_rows.index(3)
    assert alignment.fill_sources[row_of_d] == ((2, 3), (1, 1))  # z first, then y


def test_a_token_no_input_has_is_zeros():
    ids = {"x": {"a": 2, "b": 0, "c": 1}, "y": {"b": 0}}
    _, (x, y) = aligned(planner(ids=ids), ["x", "y"], None, [X, Y[:1]])
    assert torch.equal(x[3], torch.zeros(2)) and torch.equal(y[3], torch.zeros(2))


def test_forced_sources_replace_every_inputs_row():
    tokens = {
        "b": {"source": "y", "force": True},
        "a": {"source": {"kind": "zero"}, "force": True},
        "c": {"source": {"kind": "model_token", "model": "y", "token_id": 1}, "force": True},
    }
    alignment, (x, y) = aligned(planner(tokens), ["x", "y"], None, [X, Y])
    assert alignment.own == ((-1, -1, -1, -1), (-1, -1, -1, 1))
    for tensor in (x, y):
        torch.testing.assert_close(tensor[:3], torch.tensor([[0.0, 0.0], [1.0, 2.0], [3.0, 4.0]]))
    torch.testing.assert_close(x[3], torch.tensor([3.0, 4.0]))  # d: not configured, donor y


def test_an_unforced_source_fills_only_the_inputs_lacking_the_token():
    tokens = {"a": {"source": {"kind": "model_token", "model": "y", "token": "d"}}, "b": {"source": "x"}}
    _, (x, y) = aligned(planner(tokens), ["x", "y"], None, [X, Y])
    torch.testing.assert_close(x[0], torch.tensor([30.0, 31.0]))  # x has a: its own row
    torch.testing.assert_close(y[0], torch.tensor([3.0, 4.0]))  # y lacks a: y's row of d
    torch.testing.assert_close(y[1], torch.tensor([1.0, 2.0]))  # b in both: own rows, the source is unused


def test_padding_rows_are_each_inputs_mean_token_row():
    alignment, (x, y) = aligned(planner(pad=3), ["x", "y"], None, [X, Y])
    assert alignment.rows == 6 and alignment.used == 4
    expected_x = torch.tensor([30.0 + 10 + 20 + 3, 31.0 + 11 + 21 + 4]) / 4
    torch.testing.assert_close(x[4], expected_x)
    torch.testing.assert_close(x[5], expected_x)
    torch.testing.assert_close(y[4], torch.tensor([30.0 + 1 + 20 + 3, 31.0 + 2 + 21 + 4]) / 4)


def test_inputs_of_several_dtypes_align_in_the_promoted_dtype():
    _, (x, y) = aligned(planner(), ["x", "y"], None, [X.to(torch.bfloat16), Y])
    assert x.dtype == y.dtype == torch.float32


@pytest.mark.parametrize(
    ("tokens", "field"),
    [
        ({"a": {"source": "w", "force": True}}, "tokenizer.tokens.a"),  # not an input of the tensor
        ({"a": {"force": True}}, "tokenizer.tokens.a"),  # forced without a source
        ({"d": {"source": "x", "force": True}}, "tokenizer.tokens.d"),  # x lacks d
        ({"a": {"source": {"kind": "model_token", "model": "y", "token_id": 9}, "force": True}}, "tokenizer.tokens.a"),
        ({"a": {"source": {"kind": "model_token", "model": "x", "token": "q"}, "force": True}}, "tokenizer.tokens.a"),
    ],
)
def test_token_sources_that_cannot_apply_are_refused_before_reading(tokens, field):
    with pytest.raises(AlloyError) as info:
        planner(tokens).alignment(["x", "y"], None, {"x": 3, "y": 2})
    assert info.value.details["field"] == field


def test_a_token_past_an_inputs_vocab_size_is_refused():
    ids = {"x": IDS["x"], "y": {"b": 0, "d": 1}}
    with pytest.raises(AlloyError) as info:
        planner(ids=ids, beyond={"y": {"c": 5}}).alignment(["x", "y"], None, {"x": 3, "y": 2})
    assert info.value.details["model"] == "y" and info.value.details["token"] == "c"


def test_the_kernel_checks_its_inputs():
    alignment = VocabularyAlignment(rows=2, used=2, own=((0, 1),))
    with pytest.raises(KernelError):
        align_vocabulary([X, Y], alignment)
    with pytest.raises(KernelError):
        align_vocabulary([torch.ones(1, 2)], alignment)  # reads row 1 of a one-row tensor
    with pytest.raises(KernelError):
        VocabularyAlignment(rows=1, used=2, own=((0, 1),))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.embed_tokens.weight", True),
        ("lm_head.weight", True),
        ("transformer.wte.weight", True),
        ("model.language_model.embed_tokens.weight", True),
        ("transformer.wpe.weight", False),
        ("model.layers.0.mlp.up_proj.weight", False),
        ("bert.embeddings.token_type_embeddings.weight", False),
    ],
)
def test_vocabulary_tensors_are_known_by_name(name, expected):
    assert is_vocabulary_tensor(name) is expected
