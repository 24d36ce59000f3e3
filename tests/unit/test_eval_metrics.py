"""Hand-checkable metric tests: perplexity, log-likelihood choices, prototype classification."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from alloy.errors import AlloyError
from alloy.evaluation.loglik import ChoiceItem, choice_predictions, continuation_logprobs, truncate_prompt
from alloy.evaluation.perplexity import perplexity, sequence_nll
from alloy.evaluation.prototypes import mean_pool, prototype_logits
from alloy.evaluation.tasks import ClassificationTask, PerplexityTask, parse_task

torch.set_num_threads(1)
VOCAB = 4


class TableLM(torch.nn.Module):
    """A causal LM whose next-token logits depend only on the current token: ``logits[t] = table[input[t]]``.

    Its probabilities are known exactly, so every metric can be computed by hand."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone(), requires_grad=False)

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.table[input_ids])


def _table() -> torch.Tensor:
    return torch.tensor(
        [
            [2.0, 0.0, 0.0, 0.0],
            [0.0, 1.0, 3.0, 0.0],
            [1.0, 1.0, 1.0, 1.0],
            [0.0, 0.0, 0.0, 5.0],
        ]
    )


def test_perplexity_of_three_tokens_matches_hand_computation():
    table = _table()
    model = TableLM(table)
    sequence = [1, 2, 0]  # predicted: token 2 after 1, token 0 after 2
    p_2_after_1 = math.exp(3.0) / (math.exp(0) + math.exp(1) + math.exp(3) + math.exp(0))
    p_0_after_2 = 0.25
    expected = math.exp(-(math.log(p_2_after_1) + math.log(p_0_after_2)) / 2)
    value, tokens = perplexity(model, [sequence], pad_id=3, batch_size=4)
    assert tokens == 2
    assert value == pytest.approx(expected, rel=1e-6)


def test_perplexity_is_token_weighted_and_ignores_padding():
    model = TableLM(_table())
    short, long = [1, 2], [3, 3, 3, 0]
    nll_short = -math.log(math.exp(3) / (2 + math.e + math.exp(3)))
    p_3_after_3 = math.exp(5) / (3 + math.exp(5))
    p_0_after_3 = 1 / (3 + math.exp(5))
    nll_long = -(2 * math.log(p_3_after_3) + math.log(p_0_after_3))
    value, tokens = perplexity(model, [short, long], pad_id=0, batch_size=2)  # one padded batch
    assert tokens == 4
    assert value == pytest.approx(math.exp((nll_short + nll_long) / 4), rel=1e-6)


def test_sequence_nll_counts_only_real_targets():
    logits = torch.zeros(1, 3, VOCAB)
    nll, count = sequence_nll(logits, torch.tensor([[1, 2, 0]]), torch.tensor([[1, 1, 0]]))
    assert count == 1
    assert nll == pytest.approx(math.log(VOCAB))


def test_loglik_choices_pick_the_likelier_continuation():
    model = TableLM(_table())
    # after token 1 the model prefers 2; after 3 it prefers 3
    items = [
        ChoiceItem([1], [[0], [2]], label=1),
        ChoiceItem([3], [[3], [1]], label=0),
        ChoiceItem([1], [[1], [2, 2, 2, 2]], label=1),
    ]
    assert choice_predictions(model, items, pad_id=0, batch_size=3) == [1, 0, 0]
    # the four tokens "2 2 2 2" are less likely in sum than the single "1", more likely per token
    p = torch.log_softmax(_table(), -1)
    assert p[1, 1] > p[1, 2] + 3 * p[2, 2]
    assert (p[1, 2] + 3 * p[2, 2]) / 4 > p[1, 1]
    assert choice_predictions(model, items[2:], pad_id=0, batch_size=3, normalize="mean") == [1]


def test_continuation_logprob_is_the_sum_over_choice_tokens():
    model = TableLM(_table())
    p = torch.log_softmax(_table(), -1)
    [(value, count)] = continuation_logprobs(model, [[0, 1]], [[2, 3]], pad_id=0, batch_size=1)
    assert count == 2
    assert value == pytest.approx(float(p[1, 2] + p[2, 3]), rel=1e-6)


def test_prompt_truncation_keeps_the_end():
    assert truncate_prompt([1, 2, 3, 4, 5], longest_choice=2, max_length=5) == [3, 4, 5]


def test_prototype_classification_on_constructed_embeddings():
    prototypes = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    embeddings = torch.tensor([[0.9, 0.1], [0.2, 0.8], [-0.7, 0.5], [-0.5, -0.1]])
    predictions = prototype_logits(embeddings, prototypes).argmax(-1)
    assert predictions.tolist() == [0, 1, 2, 2]
    labels = torch.tensor([0, 1, 1, 2])
    assert float((predictions == labels).float().mean()) == 0.75


def test_mean_pool_ignores_padding_and_normalises():
    hidden = torch.tensor([[[1.0, 0.0], [3.0, 4.0], [100.0, 100.0]]])
    pooled = mean_pool(hidden, torch.tensor([[1, 1, 0]]))
    assert torch.allclose(pooled, torch.tensor([[2.0, 2.0]]) / math.sqrt(8))


def test_task_parsing():
    assert isinstance(parse_task({"type": "perplexity"}), PerplexityTask)
    task = parse_task({"type": "classification", "labels": ["a", "b"], "head": "loglik", "label_texts": ["x", "y"]})
    assert isinstance(task, ClassificationTask) and task.choices == ["x", "y"]
    with pytest.raises(AlloyError) as error:
        parse_task({"type": "classification", "labels": ["a", "b"]}, "d1")  # prototypes head without a head file
    assert error.value.code.value == "VALIDATION_FAILED"
    with pytest.raises(AlloyError):
        parse_task({"type": "ranking"}, "d2")
    with pytest.raises(AlloyError):
        parse_task(None, "d3")
