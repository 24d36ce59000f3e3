"""ExperimentTracker buffering, flush and log sequence numbers on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from alloy.errors import AlloyError, ErrorCode
from alloy.storage.tracker import ExperimentTracker


@pytest.fixture
def tracker(database):
    return ExperimentTracker(database)


def test_results_are_buffered_until_flush_and_readable_meanwhile(tracker, database):
    exp = tracker.create_experiment("bench", "evaluation", {"suite": "tiny"}, owner="alice")
    tracker.log_result(exp, "m1", "sentiment", "test", "accuracy", 0.75, 1.5)
    tracker.log_result(exp, "m2", "sentiment", "test", "accuracy", 0.5, 1.0)
    assert tracker.pending() == 2
    assert [(r.model_id, r.lsn) for r in tracker.results(exp)] == [("m1", None), ("m2", None)]
    assert ExperimentTracker(database).results(exp) == []  # another process sees nothing yet
    lsn = tracker.flush()
    assert lsn >= 1 and tracker.pending() == 0
    elsewhere = ExperimentTracker(database).results(exp)
    assert [(r.model_id, r.value, r.lsn) for r in elsewhere] == [("m1", 0.75, lsn), ("m2", 0.5, lsn)]
    assert elsewhere[0].created_at.tzinfo is not None


def test_lsn_advances_only_when_a_flush_writes(tracker, database):
    exp = tracker.create_experiment("e", "evaluation", {})
    empty = tracker.flush()
    assert tracker.flush() == empty
    tracker.log_result(exp, "m", None, None, "perplexity", 12.5)
    first = tracker.flush()
    assert first > empty and tracker.flush() == first
    other = ExperimentTracker(database)  # a second writer shares the sequence
    other.log_result(exp, "m", None, None, "perplexity", 11.0)
    second = other.flush()
    tracker.log_result(exp, "m", None, None, "perplexity", 10.0)
    assert second > first and tracker.flush() > second


def test_trials_upsert_by_id_and_filter_by_generation(tracker):
    exp = tracker.create_experiment("evo", "evolution", {"population": 2})
    tracker.record_trial(exp, "t0", 0, {"t": 0.3}, {"strategy": "slerp"}, {"score": 0.4})
    tracker.record_trial(exp, "t1", 0, {"t": 0.6}, {"strategy": "slerp"}, {"score": 0.5})
    tracker.flush()
    tracker.record_trial(exp, "t1", 0, {"t": 0.6}, {"strategy": "slerp"}, {"score": 0.55})  # re-scored
    tracker.record_trial(exp, "t2", 1, {"t": 0.7}, {"strategy": "slerp"}, {"score": 0.6}, parent_trial="t1")
    assert [t.metrics["score"] for t in tracker.trials(exp)] == [0.4, 0.55, 0.6]
    tracker.flush()
    trials = tracker.trials(exp)
    assert [(t.trial_id, t.metrics["score"], t.parent_trial) for t in trials] == [
        ("t0", 0.4, None),
        ("t1", 0.55, None),
        ("t2", 0.6, "t1"),
    ]
    assert [t.trial_id for t in tracker.trials(exp, generation=1)] == ["t2"]


def test_experiments_get_list_and_unknown(tracker):
    ids = [tracker.create_experiment(f"e{i}", "evolution" if i else "evaluation", {"i": i}) for i in range(3)]
    assert tracker.get_experiment(ids[1]).params == {"i": 1}
    page = tracker.list_experiments(limit=2)
    assert page.total == 3 and len(page.items) == 2
    assert tracker.list_experiments(kind="evolution").total == 2
    for call in (
        lambda: tracker.get_experiment("nope"),
        lambda: tracker.log_result("nope", "m", None, None, "acc", 1.0),
    ):
        with pytest.raises(AlloyError) as caught:
            call()
        assert caught.value.code is ErrorCode.NOT_FOUND


def test_failed_flush_keeps_the_buffer(tracker):
    exp = tracker.create_experiment("e", "evaluation", {})
    tracker.log_result(exp, "m", None, None, "acc", 1.0)
    real_write = tracker._write
    tracker._write = lambda *args: (_ for _ in ()).throw(ConnectionError("database went away"))
    with pytest.raises(ConnectionError):
        tracker.flush()
    assert tracker.pending() == 1
    tracker._write = real_write
    assert tracker.flush() >= 1 and tracker.pending() == 0
