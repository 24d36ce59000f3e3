"""GenomePBT's synchronous rounds after ``Tuner.restore``, without a cluster: restored trials report at different
generations, and no round may run until every live trial is level (a round between a laggard and a leader hands
the laggard a later generation, and the generations in between are never evaluated)."""

from __future__ import annotations

from dataclasses import dataclass

from ray.tune.experiment import Trial
from ray.tune.schedulers import TrialScheduler
from ray.tune.schedulers.pbt import _PBTTrialState

from evolution.search import GenomePBT


@dataclass(eq=False)
class FakeTrial:
    trial_id: str
    status: str = Trial.RUNNING
    experiment_tag: str = ""


class FakeController:
    def __init__(self, trials):
        self.trials = trials

    def get_live_trials(self):
        return [t for t in self.trials if t.status != Trial.TERMINATED]

    def get_trials(self):
        return list(self.trials)


def restored_scheduler(trials) -> GenomePBT:
    """A scheduler as Tuner.restore rebuilds it: fresh state for trials that are already mid-run."""
    scheduler = GenomePBT(
        time_attr="generation",
        metric="fitness",
        mode="max",
        perturbation_interval=1,
        synch=True,
        custom_explore_fn=lambda config: config,
    )
    for trial in trials:
        scheduler._trial_state[trial] = _PBTTrialState(trial)
    return scheduler


def result(generation: int, fitness: float = 0.5) -> dict:
    return {"generation": generation, "fitness": fitness, "training_iteration": generation + 1}


def test_a_restored_laggard_runs_on_and_no_round_starts_until_every_trial_is_level():
    leader, laggard, other = FakeTrial("a"), FakeTrial("b"), FakeTrial("c")
    controller = FakeController([leader, laggard, other])
    scheduler = restored_scheduler(controller.trials)

    # The leader comes back at generation 4 and waits (paused) for the others.
    assert scheduler.on_trial_result(controller, leader, result(4, 0.9)) == TrialScheduler.PAUSE
    assert scheduler._next_perturbation_sync == 4
    # The laggards come back at generation 3: recorded, and they run on instead of starting a round.
    assert scheduler.on_trial_result(controller, laggard, result(3, 0.1)) == TrialScheduler.CONTINUE
    assert scheduler.on_trial_result(controller, other, result(3, 0.2)) == TrialScheduler.CONTINUE
    assert scheduler._trial_state[laggard].last_train_time == 3
    assert scheduler._num_perturbations == 0  # no exploit yet
    # PBT would resume the laggards (they are before the barrier), not the leader.
    leader.status = laggard.status = other.status = Trial.PAUSED
    assert scheduler.choose_trial_to_run(controller) in (laggard, other)


def test_an_uninterrupted_generation_is_unchanged():
    """Every trial at the same generation: the last one to report is the one Ray's synchronous round starts with
    (the level-hold never fires)."""
    trials = [FakeTrial("a"), FakeTrial("b")]
    controller = FakeController(trials)
    scheduler = restored_scheduler(trials)
    assert scheduler.on_trial_result(controller, trials[0], result(1, 0.9)) == TrialScheduler.PAUSE
    assert scheduler._trial_state[trials[0]].last_train_time == 1
    assert scheduler._next_perturbation_sync == 1
