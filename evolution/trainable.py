"""The Ray Tune trainable: one trial is one lineage of candidates; one training iteration is one generation.

Each iteration decodes the trial's genome into a recipe, merges the parents **in memory**
(``alloy.merge.executor.merge_state_dicts``; the parents arrive once per node through the object store), scores
the candidate on this generation's rotating dev batch (or, with ``fidelity: asha``, rung after rung of
:mod:`evolution.racing` while it clears the cutoffs in its config) and reports ``fitness`` (``full_dev`` says
whether it is the whole dev split's) with a tiny checkpoint holding the genome (JSON), never weights.

Where the genome lives (the PBT donor-checkpoint pitfall): the genome is the trial's *config*, and PBT's exploit
copies the donor's config (then perturbs it); the donor's generation and candidate id reach the recipient in the
config too (``lineage``, stamped by :class:`evolution.search.GenomePBT` from the donor's last *result*). So a
recipient never needs the donor's checkpoint files to know what to evaluate next. The checkpoint is only used
when a trial resumes its *own* progress (``Tuner.restore`` after a forced shutdown). Tune itself still refuses to
restore from a deleted checkpoint, so the runner also keeps every checkpoint (they are a few hundred bytes).

A genome is scored once per run. The driver's search objects hand trials unseen genomes (see
:class:`evolution.scoring.FitnessLedger`); a trial told that its genome was scored already (config ``cached``:
the candidate and its fitness) reports that fitness with ``repeat_of`` instead of ``candidate_id``: PBT can
still rank it, and it is no new candidate. A trial that runs on in one call steps its genome itself.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from alloy.merge.executor import merge_state_dicts
from evolution.genome import Genome, GenomeSpace
from evolution.objectives import objectives_of
from evolution.parents import ParentArrays, as_tensors
from evolution.racing import Batch, Racing, race
from evolution.scoring import CandidateScorer, FitnessRecord, ScorerSpec, cached_scorer, genome_key

if TYPE_CHECKING:  # torch loads only in processes that handle tensors
    import torch

GENOME_KEY = "genome"
LINEAGE_KEY = "lineage"
ORDINAL_KEY = "ordinal"
CACHED_KEY = "cached"  # the FitnessRecord of a genome the run already scored, set by the driver
RUNG_CUTOFFS_KEY = "rung_cutoffs"  # fidelity asha: each rung's bar, from earlier generations (evolution.racing)
STEP_SIGMA = 0.1  # a trial's own step when it runs on in one call (SearchSettings.sigma's default)
STATE_FILE = "genome.json"


class TrialSetup(BaseModel):
    """Everything a trial needs besides its config and the shared parents; small and picklable."""

    space: GenomeSpace
    scorer: ScorerSpec
    generations: int = Field(ge=1)
    dev_batch_size: int | None = None
    batch_seed: int = 0
    device: str = "cpu"
    torch_threads: int = 1
    # CMA-ES runs one iteration per trial; its "generation" is the trial's ordinal // population.
    ordinal_generations: int | None = None
    # Which run of the search this is (a fresh id per Tuner.fit, new after Tuner.restore): see _resume_state.
    incarnation: str = ""
    racing: Racing | None = None  # fidelity asha: the rung schedule (then dev_batch_size is None)


class CandidateState(BaseModel):
    """The checkpoint's content, and the lineage passed in configs."""

    trial_id: str | None = None
    candidate_id: str | None = None
    generation: int = 0
    genome: Genome | None = None
    parent_candidate: str | None = None
    incarnation: str = ""
    rerun: bool = False  # run ``genome`` (the checkpoint's own) again: see _resume_state


def seed_sources(seed: int, generation: int) -> None:
    """Seed Python's, numpy's and torch's global generators for one generation of a trial. The merge itself draws
    from per-tensor generators seeded by the recipe; this keeps anything else that draws (a scorer, a library)
    the same from run to run."""
    import numpy
    import torch

    value = (seed * 1_000_003 + generation) % (1 << 32)
    random.seed(value)
    numpy.random.seed(value)
    torch.manual_seed(value)


def rotating_batch(generation: int, size: int, batch_size: int | None, seed: int) -> list[int] | None:
    """The dev examples scored at ``generation`` (1-based): a fixed seeded permutation cut into consecutive
    windows, so every candidate of one generation is compared on the same examples and successive generations
    see fresh ones (no candidate can win by fitting one small batch)."""
    if batch_size is None or batch_size >= size:
        return None
    order = list(range(size))
    random.Random(seed).shuffle(order)
    start = ((generation - 1) * batch_size) % size
    window = order[start : start + batch_size]
    if len(window) < batch_size:  # wrap around the end of the permutation
        window += order[: batch_size - len(window)]
    return sorted(window)


def _resume_state(trial_id: str, config: dict[str, Any], incarnation: str) -> CandidateState:
    """Where this trial continues from (the state *after which* it runs its next generation): its own checkpoint
    (PBT resuming a paused trial, or Tuner.restore), or the lineage in its config (PBT exploit)."""
    # lazy: Ray Tune loads only in a process that runs a search
    from ray import tune

    lineage = CandidateState.model_validate(config.get(LINEAGE_KEY) or {})
    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return lineage
    try:
        with checkpoint.as_directory() as folder:
            own = CandidateState.model_validate_json(open(os.path.join(folder, STATE_FILE)).read())
    except (OSError, ValueError):
        return lineage  # unreadable or gone: the config still says everything needed
    if own.trial_id != trial_id or own.generation < lineage.generation:
        return lineage
    if own.incarnation != incarnation:
        # Written by a run that was killed: re-run the checkpoint's own generation. Tune 2.60 can reuse a
        # registered checkpoint folder for a trial's next checkpoint (see the README, "Evolution"), so after a
        # forced shutdown the folder the snapshot names may hold a generation whose result the killed driver
        # never processed (never recorded). Re-running it records it; when it was recorded, the rerun
        # (deterministic: same genome, same batch, seeded merge) replaces the record with the same values.
        return CandidateState(
            trial_id=trial_id,
            candidate_id=own.parent_candidate,
            generation=own.generation - 1,
            genome=own.genome,
            rerun=True,
        )
    return own


def rotating_batches(
    generation: int, sizes: dict[str, int], batch_size: int | None, seed: int
) -> dict[str, list[int] | None] | None:
    """:func:`rotating_batch` for every fitness dataset (``batch_size`` examples of each)."""
    if batch_size is None:
        return None
    return {dataset_id: rotating_batch(generation, size, batch_size, seed) for dataset_id, size in sizes.items()}


def evolution_trainable(config: dict[str, Any], parents: ParentArrays, data: Any, setup: TrialSetup) -> None:
    # lazy: torch loads only in processes that handle tensors
    import torch
    from ray import tune

    torch.set_num_threads(setup.torch_threads)
    trial_id = tune.get_context().get_trial_id()
    space = setup.space
    state = _resume_state(trial_id, config, setup.incarnation)
    # A rerun repeats the checkpoint's own genome; otherwise the config names the genome to run next.
    genome = space.validate_genome(state.genome if state.rerun and state.genome else config[GENOME_KEY])
    known = config.get(CACHED_KEY) if not state.rerun else None
    known = FitnessRecord.model_validate(known) if known else None
    scorer = cached_scorer(setup.scorer, data)
    tensors = as_tensors(parents)

    generation = state.generation
    parent_candidate = state.candidate_id
    if setup.ordinal_generations:
        generation = int(config.get(ORDINAL_KEY, 0)) // setup.ordinal_generations
    while generation < setup.generations:
        generation += 1
        seed_sources(setup.batch_seed, generation)
        if known is not None:
            result = _repeat_result(known, genome, generation, parent_candidate)
            candidate_id = known.candidate_id
        else:
            cutoffs = config.get(RUNG_CUTOFFS_KEY) or []
            result = _score(space, genome, tensors, scorer, setup, generation, parent_candidate, trial_id, cutoffs)
            candidate_id = result["candidate_id"]
        _report(
            result,
            CandidateState(
                trial_id=trial_id,
                candidate_id=candidate_id,
                generation=generation,
                genome=genome,
                parent_candidate=parent_candidate,
                incarnation=setup.incarnation,
            ),
        )
        parent_candidate = candidate_id
        if setup.ordinal_generations:
            return
        # Still running in this call: PBT pauses every trial after each generation and restarts it with its next
        # genome, except a laggard after Tuner.restore (GenomePBT lets it run on to the leaders' generation). Its
        # config still names the genome just run, so it takes its mutation step here, seeded by the run's seed,
        # the generation and the genome (a restored run is not bit-for-bit the uninterrupted one anyway).
        genome, known = _step(space, genome, setup.batch_seed, generation), None


def _step(space: GenomeSpace, genome: Genome, seed: int, generation: int) -> Genome:
    """A mutation of ``genome`` (the search's default step) that is not ``genome`` itself."""
    rng = random.Random(f"step:{seed}:{generation}:{genome_key(space, genome)}")
    for _ in range(32):
        child = space.perturb(genome, rng, sigma=STEP_SIGMA, resample_probability=0.0)
        if genome_key(space, child) != genome_key(space, genome):
            return child
    return space.sample(rng)


def _score(
    space: GenomeSpace,
    genome: Genome,
    tensors: dict[str, dict[str, torch.Tensor]],
    scorer: CandidateScorer,
    setup: TrialSetup,
    generation: int,
    parent_candidate: str | None,
    trial_id: str,
    cutoffs: list[float | None] | None = None,
) -> dict[str, Any]:
    """Merge and score one candidate (on its generation's dev batch, or rung after rung); its result row."""

    recipe = space.decode(genome)
    cpu_started = time.process_time()  # this process's CPU (torch runs setup.torch_threads threads in it)
    started = time.perf_counter()
    merged = merge_state_dicts(recipe, tensors, device=setup.device)
    merged_at = time.perf_counter()
    racing: dict[str, Any] = {}
    if setup.racing is None:
        batches: list[Batch] = [rotating_batches(generation, scorer.sizes, setup.dev_batch_size, setup.batch_seed)]
        metrics = scorer.score(merged, batch_indices=batches[0])
    else:
        schedule = setup.racing.batches(scorer.sizes)
        rung_scores, metrics = _race(scorer, merged, schedule, cutoffs or [])
        batches = schedule[: len(rung_scores)]
        racing = {"rung": len(rung_scores) - 1, "rung_scores": rung_scores}
    scored_at = time.perf_counter()
    del merged
    full_dev = batches[-1] is None or all(chosen is None for chosen in batches[-1].values())
    examples = sum(_examples(batch, scorer.sizes) for batch in batches)
    cpu_s = time.process_time() - cpu_started
    recorded = {**metrics, **racing, "full_dev": full_dev, "examples_scored": examples, "cpu_s": cpu_s}
    return {
        "fitness": metrics["fitness"],
        **objectives_of(metrics, scorer.spec.dataset_ids, scorer.sign),
        "generation": generation,
        "candidate_id": f"{trial_id}-g{generation:03d}",
        "parent_candidate": parent_candidate or "",
        "genome_json": json.dumps(genome, sort_keys=True),
        "recipe_json": json.dumps(recipe.model_dump(mode="json", exclude_none=True), sort_keys=True),
        "metrics_json": json.dumps(recorded, sort_keys=True),
        "batch_examples": _examples(batches[-1], scorer.sizes),
        "full_dev": full_dev,
        **({"rung": racing["rung"], "rung_scores_json": json.dumps(racing["rung_scores"])} if racing else {}),
        "merge_s": merged_at - started,
        "score_s": scored_at - merged_at,
    }


def _race(
    scorer: CandidateScorer, merged: dict[str, torch.Tensor], schedule: list[Batch], cutoffs: list[float | None]
) -> tuple[list[float], dict[str, float]]:
    """The rung scores a merged candidate reaches, and the metrics of its last rung."""
    reached: list[dict[str, float]] = []

    def score_rung(rung: int) -> float:
        # the candidate's weights are loaded into the skeleton once, for its first rung
        batch = schedule[rung]
        reached.append(scorer.score(merged, batch_indices=batch) if rung == 0 else scorer.score_loaded(batch))
        return reached[-1]["fitness"]

    return race(score_rung, cutoffs, len(schedule)), reached[-1]


def _repeat_result(
    known: FitnessRecord, genome: Genome, generation: int, parent_candidate: str | None
) -> dict[str, Any]:
    """The result of a genome the run already scored: its recorded fitness, and no ``candidate_id`` (the
    candidate callback records only rows that have one)."""
    return {
        "fitness": known.fitness,
        **known.objectives,
        "generation": generation,
        "repeat_of": known.candidate_id,
        "full_dev": known.full_dev,  # a recorded estimate stays an estimate
        "parent_candidate": parent_candidate or "",
        "genome_json": json.dumps(genome, sort_keys=True),
        "merge_s": 0.0,
        "score_s": 0.0,
    }


def _examples(batch: Batch, sizes: dict[str, int]) -> int:
    if batch is None:
        return sum(sizes.values())
    return sum(sizes[d] if chosen is None else len(chosen) for d, chosen in batch.items())


def _report(result: dict[str, Any], state: CandidateState) -> None:
    # lazy: Ray Tune loads only in a process that runs a search
    from ray import tune

    with tempfile.TemporaryDirectory(prefix="alloy-genome-") as folder:
        with open(os.path.join(folder, STATE_FILE), "w") as handle:
            handle.write(state.model_dump_json())
        tune.report(result, checkpoint=tune.Checkpoint.from_directory(folder))
