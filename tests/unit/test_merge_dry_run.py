"""The pre-flight dry run: the executor's own plan and shard layout, parameters as the merge resolves them, the
compatibility verdict instead of an error, estimates from the executor's schedule; the CLI reads no weight and
writes nothing; the executor's in-flight budget counts working bytes."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from click.testing import CliRunner

from alloy.errors import AlloyError
from alloy.merge import footprint, speed, streamed
from alloy.merge.dry_run import dry_run
from alloy.merge.executor import execute_merge, prepare
from alloy.merge.footprint import BASE_RSS_BYTES, replay_schedule, working_bytes
from alloy.merge.recipe import MergeRecipe
from alloy.model_manifest import read_manifest

LIMITS = {"shard_bytes": 20_000, "workers": 2, "max_in_flight": 4, "budget_bytes": 512 * 1024**2}


def ties_recipe(base, tunes, **changes) -> MergeRecipe:
    fields = {
        "models": [str(base), *map(str, tunes)],
        "strategy": "ties",
        "base_model": str(base),
        "parameters": {"density": 0.5},
        **changes,
    }
    return MergeRecipe.from_request_fields(**fields)


@pytest.fixture
def family(tiny_family):
    base, tunes = tiny_family
    return base, tunes[:2]


def manifests_of(recipe: MergeRecipe) -> dict:
    return {m: read_manifest(m) for m in recipe.model_ids}


def test_the_plan_and_shards_are_what_the_merge_writes(family, tmp_path):
    base, tunes = family
    recipe = ties_recipe(base, tunes, parameters={"density": [0.2, 0.8], "weight": 1.0})
    report = dry_run(recipe, manifests_of(recipe), **LIMITS)
    result = execute_merge(recipe, {m: m for m in recipe.model_ids}, tmp_path / "out", shard_bytes=20_000)
    written = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert report.compatibility.compatible
    assert report.tensors == result.tensors
    assert [s.file for s in report.shards] == written
    assert report.estimates is not None and report.estimates.disk_bytes == result.bytes
    assert report.output_layers == 2
    density = next(p for p in report.parameters if p.name == "density")
    assert density.scope == "per_input" and density.min == 0.2 and density.max == 0.8  # the gradient, resolved
    assert report.estimates.peak_memory_bytes >= BASE_RSS_BYTES


def test_a_given_start_replaces_the_calibrated_one_and_the_planning_time_is_added(family, monkeypatch):
    """A warm engine's dry run (start 0) leaves out a fresh process's calibrated start; a given start counts, with
    the dry run's own planning time on top (here a planning made to take 0.3 s)."""
    base, tunes = family
    recipe = ties_recipe(base, tunes)
    fixed = {"cpus": 2, "load": 0.0}
    monkeypatch.setattr("alloy.merge.dry_run.slowness", lambda: 1.0)
    calibrated = dry_run(recipe, manifests_of(recipe), **LIMITS, **fixed).estimates
    warm = dry_run(recipe, manifests_of(recipe), **LIMITS, **fixed, startup_s=0.0).estimates
    started = dry_run(recipe, manifests_of(recipe), **LIMITS, **fixed, startup_s=1.0).estimates
    assert calibrated.cpu_seconds - warm.cpu_seconds == pytest.approx(footprint.STARTUP_S, abs=0.1)
    assert started.cpu_seconds - warm.cpu_seconds == pytest.approx(1.0, abs=0.1)
    assert warm.wall_seconds < 1.0 < footprint.STARTUP_S <= calibrated.wall_seconds

    def slow_prepare(*args, **kwargs):
        time.sleep(0.3)
        return prepare(*args, **kwargs)

    monkeypatch.setattr("alloy.merge.executor.prepare", slow_prepare)
    slow = dry_run(recipe, manifests_of(recipe), **LIMITS, **fixed, startup_s=0.0).estimates
    assert slow.cpu_seconds - warm.cpu_seconds == pytest.approx(0.3, abs=0.1)


def test_incompatible_models_are_a_verdict_not_an_error(tiny_model_factory):
    a = tiny_model_factory("llama", seed=0)
    b = tiny_model_factory("llama", seed=0, hidden=64)
    recipe = ties_recipe(a, [b])
    report = dry_run(recipe, manifests_of(recipe), **LIMITS)
    assert not report.compatibility.compatible
    assert report.compatibility.code == "INCOMPATIBLE_MODELS"
    assert report.shards == [] and report.estimates is None


def test_a_bad_parameter_is_still_refused(family):
    base, tunes = family
    with pytest.raises(AlloyError) as caught:
        dry_run(ties_recipe(base, tunes, parameters={"density": 3.0}), manifests_of(ties_recipe(base, tunes)), **LIMITS)
    assert caught.value.code.value == "VALIDATION_FAILED"


def test_the_replayed_peak_follows_the_budget(family):
    base, tunes = family
    recipe = ties_recipe(base, tunes)
    plan = prepare(recipe, manifests_of(recipe))
    largest = max(working_bytes(plan, t) for t in plan.tasks)
    alone = replay_schedule(plan, plan.tasks, workers=2, max_in_flight=4, budget_bytes=1, cpus=2)
    wide = replay_schedule(plan, plan.tasks, workers=2, max_in_flight=4, budget_bytes=10**12, cpus=2)
    assert alone.peak_bytes == BASE_RSS_BYTES + largest  # one task at a time
    assert alone.peak_bytes <= wide.peak_bytes <= BASE_RSS_BYTES + 2 * largest  # two lanes


def test_cli_dry_run_prints_the_plan_and_writes_nothing(family, tmp_path):
    from alloy.cli.merge import merge

    base, tunes = family
    recipe_file = tmp_path / "ties.yml"
    lines = [f"merge_method: ties\nbase_model: {base}\nmodels:\n  - model: {base}"]
    lines += [f"  - model: {t}\n    parameters: {{weight: 1.0, density: 0.5}}" for t in tunes]
    recipe_file.write_text("\n".join(lines) + "\ndtype: float32\n")
    result = CliRunner().invoke(merge, ["--dry-run", "--json", str(recipe_file)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["compatibility"]["compatible"] and report["method"] == "ties"
    assert report["estimates"]["peak_memory_bytes"] > 0 and report["shards"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ties.yml"]
    text = CliRunner().invoke(merge, ["--dry-run", str(recipe_file)])
    assert text.exit_code == 0 and "estimates: peak memory" in text.output
    missing = CliRunner().invoke(merge, [str(recipe_file)])
    assert missing.exit_code != 0 and "OUT_DIR is required" in missing.output


def test_the_calibrated_times_scale_with_the_machines_slowness_and_memory_does_not(family):
    base, tunes = family
    recipe = ties_recipe(base, tunes)
    plan = prepare(recipe, manifests_of(recipe))
    limits = {"workers": 2, "max_in_flight": 4, "budget_bytes": 10**12, "cpus": 2}
    here = replay_schedule(plan, plan.tasks, **limits)
    twice = replay_schedule(plan, plan.tasks, **limits, slowness=2.0)
    assert twice.cpu_s == pytest.approx(2 * here.cpu_s) and twice.wall_s == pytest.approx(2 * here.wall_s)
    assert twice.peak_bytes == here.peak_bytes


def test_the_measured_kernel_time_and_start_are_added_as_they_are(family):
    """The kernel's measured nanoseconds count once per input element of every merged tensor, unscaled; a measured
    start replaces the calibrated one."""
    base, tunes = family
    recipe = ties_recipe(base, tunes)
    plan = prepare(recipe, manifests_of(recipe))
    limits = {"workers": 1, "max_in_flight": 4, "budget_bytes": 10**12, "cpus": 2, "slowness": 3.0}
    bare = replay_schedule(plan, plan.tasks, **limits, startup_s=0.0)
    kernel = replay_schedule(plan, plan.tasks, **limits, startup_s=0.0, kernel_ns=10.0)
    started = replay_schedule(plan, plan.tasks, **limits, startup_s=5.0, kernel_ns=10.0)
    elements = sum(footprint.task_numel(t) * len(t.sources) for t in plan.tasks if t.compute)
    assert kernel.cpu_s - bare.cpu_s == pytest.approx(elements * 10e-9)
    assert started.cpu_s - kernel.cpu_s == pytest.approx(5.0)
    default = replay_schedule(plan, plan.tasks, **limits, kernel_ns=10.0)
    assert default.cpu_s - kernel.cpu_s == pytest.approx(footprint.STARTUP_S * 3.0)


def test_a_streamed_slerp_reads_its_inputs_twice_in_the_estimate(family):
    base, tunes = family
    recipe = MergeRecipe.from_request_fields(
        models=[str(base), str(tunes[0])], strategy="slerp", base_model=str(base), parameters={"t": 0.5}
    )
    plan = prepare(recipe, manifests_of(recipe))
    task = next(t for t in plan.tasks if t.compute and len(t.shape) == 2)
    large = dataclasses.replace(task, shape=(4096, 1024))  # past STREAM_MIN_ELEMENTS
    assert streamed.streams(plan, large) and not streamed.streams(plan, task)
    per_element = [footprint.compute_seconds(plan, t, 0.0, 1.0) / footprint.task_numel(t) for t in (task, large)]
    assert per_element[1] == pytest.approx(2 * per_element[0])


def test_the_kernel_probe_cuts_whole_rows():
    assert speed.probe_shape((24000, 1024)) == (speed.PROBE_ELEMENTS // 1024, 1024)
    assert speed.probe_shape((64, 128)) == (64, 128)  # smaller than the probe: whole
    assert speed.probe_shape((10, 3 * speed.PROBE_ELEMENTS)) == (1, 3 * speed.PROBE_ELEMENTS)  # one row at least
    assert speed.probe_shape((9, 4, 1024)) == (9, 4, 1024)
    assert speed.probe_shape((speed.PROBE_ELEMENTS * 2,)) == (speed.PROBE_ELEMENTS,)


def test_the_kernel_probe_times_the_plans_largest_merged_tensor_once(family, monkeypatch):
    base, tunes = family
    recipe = ties_recipe(base, tunes)
    plan = prepare(recipe, manifests_of(recipe))
    task = speed.probe_task(plan)
    assert task.compute and footprint.task_numel(task) == max(footprint.task_numel(t) for t in plan.tasks if t.compute)
    timed = []
    real = speed._time_kernel
    monkeypatch.setattr(speed, "_time_kernel", lambda *args: timed.append(args[1].shape) or real(*args))
    monkeypatch.setattr(speed, "_kernel_rates", {})
    first = speed.kernel_ns_per_input_element(plan, task, 1, 2)
    assert speed.kernel_ns_per_input_element(plan, task, 1, 2) == first > 0 and len(timed) == 1
    assert timed == [speed.probe_shape(task.shape)]
    speed.kernel_ns_per_input_element(plan, task, 1, 1)  # another number of lanes is another measurement
    assert len(timed) == 2


def test_the_kernel_probe_tells_a_costly_method_from_a_cheap_one(family):
    """DELLA ranks, draws and masks every delta; task arithmetic adds them: on the same tensor its kernel costs
    several times more per element (measured 18-20 vs 0.4-0.5 ns on 2 vCPUs)."""
    base, tunes = family
    timings = {}
    cases = (("task_arithmetic", None, {"weight": 1.0}), ("ties", "della", {"density": 0.5, "epsilon": 0.1}))
    for strategy, variant, parameters in cases:
        recipe = MergeRecipe.from_request_fields(
            models=[str(base), *map(str, tunes)],
            strategy=strategy,
            variant=variant,
            base_model=str(base),
            parameters=parameters,
            seed=1,
        )
        plan = prepare(recipe, manifests_of(recipe))
        task = dataclasses.replace(speed.probe_task(plan), shape=(512, 512))
        timings[plan.method.name] = speed._time_kernel(plan, task, 1, 1)
    assert timings["della"] > 4 * timings["task_arithmetic"]


def test_the_speed_probe_runs_on_the_calling_thread_and_is_measured_once(monkeypatch):
    from alloy.merge import speed

    calls = []
    monkeypatch.setattr(speed, "probe_seconds", lambda: calls.append(1) or 2 * speed.CALIBRATION_PROBE_S)
    speed.slowness.cache_clear()
    try:
        assert speed.slowness() == speed.slowness() == pytest.approx(2.0) and calls == [1]
    finally:
        speed.slowness.cache_clear()
    measured = speed.probe_seconds()
    assert 0 < measured < 50 * speed.CALIBRATION_PROBE_S  # thread CPU seconds of a 2M-element pass, not a hang


def test_the_report_gives_the_slowness_its_times_were_scaled_by(family):
    base, tunes = family
    recipe = ties_recipe(base, tunes)
    report = dry_run(recipe, manifests_of(recipe), **LIMITS)
    assert report.estimates.machine_slowness > 0


def test_a_slow_kernel_is_timed_once(family, monkeypatch):
    """A run past SLOW_RUN_S is not repeated (an SVD method's probe run takes seconds); a quick one is."""
    import time

    base, tunes = family
    recipe = ties_recipe(base, tunes)
    plan = prepare(recipe, manifests_of(recipe))
    task = dataclasses.replace(speed.probe_task(plan), shape=(4, 4))
    calls = []

    def busy(seconds):
        def kernel(*args, **kwargs):
            calls.append(1)
            start = time.process_time()
            while time.process_time() - start < seconds:
                pass

        return kernel

    monkeypatch.setattr(speed, "compute_tensor", busy(speed.SLOW_RUN_S + 0.05))
    speed._time_kernel(plan, task, 1, 1)
    assert len(calls) == 1
    calls.clear()
    monkeypatch.setattr(speed, "compute_tensor", busy(0.0))
    speed._time_kernel(plan, task, 1, 1)
    assert len(calls) == speed.KERNEL_RUNS


def test_a_task_over_the_budget_is_replayed_faster_on_more_lanes(family):
    """A 1-byte budget: every task runs alone, on every lane's cores (footprint.alone_speedup); the CPU seconds
    are the same."""
    base, tunes = family
    recipe = ties_recipe(base, tunes)
    plan = prepare(recipe, manifests_of(recipe))
    limits = {"max_in_flight": 4, "budget_bytes": 1, "cpus": 2, "startup_s": 0.0, "kernel_ns": 10.0}
    one = replay_schedule(plan, plan.tasks, workers=1, **limits)
    two = replay_schedule(plan, plan.tasks, workers=2, **limits)
    assert two.cpu_s == pytest.approx(one.cpu_s)
    assert two.wall_s == pytest.approx(one.wall_s / footprint.alone_speedup(2)) and two.wall_s < one.wall_s
