"""The sweep's measurement plan (`gnsweep.noise_plan`): pure, no process."""

import math

import pytest

from gnsweep.config import Config, NoiseConfig, TaskConfig
from gnsweep.errors import ConfigError
from gnsweep.noise import pooled_variance_growth
from gnsweep.noise_plan import (
    ALL,
    DENSE,
    NEEDED,
    OFF,
    Assignment,
    Outcome,
    best_rates,
    guessed_rate,
    measured_as_planned,
    middle_rate,
    plan_runs,
    summary,
)
from gnsweep.runs import RunSpec

RATES = [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4]
BATCHES = [8, 64, 512]


def grid(seeds=(0,), rates=RATES, batches=BATCHES):
    return [RunSpec(b, lr, s) for b in batches for lr in rates for s in seeds]


def measuring(plan):
    return {(r.split("_")[0], r.split("_")[1]) for r, a in plan.items() if a.measures}


def test_runs_all_measures_every_run():
    specs = grid(seeds=(0, 1))
    plan = plan_runs(specs, "all", {})
    assert set(plan) == {s.run_id for s in specs}
    assert all(a.role == ALL and a.measures for a in plan.values())


def test_auto_measures_the_two_rates_nearest_a_guess_that_rises_with_the_batch_size():
    specs = grid(seeds=(0, 1))
    plan = plan_runs(specs, "auto", {})
    assert set(plan) == {s.run_id for s in specs}  # every run has a part and a reason
    on = [s for s in specs if plan[s.run_id].measures]
    # 0.1..6.4 spans 6 octaves: the guess is 1.5 octaves up at batch 8, the middle (3) at 64
    # (halfway in log batch size), 4.5 at 512. Ties go to the larger, faster rate. The first
    # seed only.
    assert middle_rate(RATES) == pytest.approx(0.8)
    assert [guessed_rate(RATES, b, BATCHES) for b in BATCHES] == pytest.approx(
        [0.1 * 2 ** 1.5, 0.8, 0.1 * 2 ** 4.5])
    assert guessed_rate(RATES, 64, [64]) == pytest.approx(0.8)  # one batch size: the middle
    assert sorted((s.batch_size, s.learning_rate, s.seed) for s in on) == sorted(
        [(8, 0.2, 0), (8, 0.4, 0), (64, 0.8, 0), (64, 1.6, 0), (512, 1.6, 0), (512, 3.2, 0)])
    assert all(plan[s.run_id].role == DENSE for s in on)
    assert all(a.why for a in plan.values())


def test_auto_follows_the_best_rate_known_per_batch_size():
    specs = grid()
    best = {(0, 8): 0.2, (0, 64): 1.6, (0, 512): 6.4}
    plan = plan_runs(specs, "auto", {}, best)
    on = {(s.batch_size, s.learning_rate) for s in specs if plan[s.run_id].measures}
    assert on == {(8, 0.2), (8, 0.4), (64, 1.6), (64, 3.2), (512, 6.4), (512, 3.2)}
    assert "best learning rate so far" in plan[RunSpec(8, 0.2).run_id].why


def test_a_planned_run_keeps_its_part_and_a_later_round_adds_its_nearest_run():
    first = grid(rates=[0.1, 0.4, 1.6])
    plan = plan_runs(first, "auto", {})
    # The planner's next round adds rates near the best found (0.1 at every batch size).
    later = first + grid(rates=[0.05, 0.2])
    planned = dict(plan)
    fresh = plan_runs(later, "auto", planned, {(0, b): 0.1 for b in BATCHES})
    assert not set(fresh) & set(planned)  # decided once: never planned again
    assert set(fresh) == {s.run_id for s in later} - set(planned)
    for b in BATCHES:
        # 0.1 and 0.05/0.2 are the nearest now; 0.1 was planned off in round one and stays
        # so, but each batch size still gets dense runs among the nearest.
        dense = [r for r, a in {**planned, **fresh}.items()
                 if a.role == DENSE and r.startswith(f"b{b:05d}")]
        assert len(dense) >= 2
        assert any(fresh.get(RunSpec(b, lr).run_id, Assignment(OFF, "")).role == DENSE
                   for lr in (0.05, 0.2))
    # Planning the same runs again changes nothing.
    assert plan_runs(later, "auto", {**planned, **fresh}) == {}


def test_adaptive_and_along_runs_always_measure_and_branch_points_are_planned_apart():
    specs = [RunSpec(0, 0.5, 0, exchange_rate=1000.0), RunSpec(0, 0.5, 0, along=True)]
    specs += [RunSpec(64, lr, 0, at_examples=at) for lr in (0.1, 0.4, 1.6, 6.4)
              for at in (1000, 8000)]
    plan = plan_runs(specs, "auto", {})
    assert plan[specs[0].run_id].role == NEEDED and plan[specs[1].run_id].role == NEEDED
    for at in (1000, 8000):
        on = sorted(s.learning_rate for s in specs[2:]
                    if s.at_examples == at and plan[s.run_id].measures)
        assert on == [0.4, 1.6]


def test_best_rates_fewest_steps_among_runs_that_reached_else_lowest_loss():
    outcomes = [Outcome(8, 0.1, 0, 900, 0.029, True), Outcome(8, 0.4, 0, 300, 0.03, True),
                Outcome(8, 1.6, 0, 50, 2.3, False),
                Outcome(64, 0.1, 0, 500, 0.5, False), Outcome(64, 0.4, 0, 500, 0.2, False),
                Outcome(64, 6.4, 0, 500, math.nan, False)]
    assert best_rates(outcomes) == {(0, 8): 0.4, (0, 64): 0.4}
    # A metric that rises (a return): the highest final value is the best.
    assert best_rates(outcomes[3:5], falling=False) == {(0, 64): 0.1}


def test_unknown_runs_value_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"noise\.runs: 'some' is not one of auto, all"):
        NoiseConfig(runs="some")
    with pytest.raises(ValueError, match=r"noise\.runs"):
        plan_runs([], "some", {})


def test_a_run_planned_off_trains_with_measurement_off_and_the_others_as_configured():
    config = Config(task=TaskConfig(name="digits"))
    off = measured_as_planned(config, Assignment(OFF, "x"))
    assert off.noise.method == "none" and config.noise.method == "auto"
    assert off.sweep == config.sweep and off.train == config.train
    assert measured_as_planned(config, Assignment(DENSE, "x")) is config
    assert measured_as_planned(config, None) is config
    script = Config(task=TaskConfig(name="script", options={"command": "python x.py"}))
    assert measured_as_planned(script, Assignment(OFF, "x")).noise.method == "none"


def test_summary_counts_what_measures():
    plan = plan_runs(grid(), "auto", {})
    line = summary(plan)
    assert "6 of 21 runs measure" in line and "15 off" in line
    assert "every run measures" in summary(plan_runs(grid(), "all", {}))


def test_a_relaunch_adding_a_seed_measures_the_best_rates_the_first_guess_missed():
    first = grid()
    # The guess: 0.2 and 0.4 at batch 8, 0.8 and 1.6 at 64, 1.6 and 3.2 at 512.
    planned = plan_runs(first, "auto", {})
    seeds = first + grid(seeds=(1,))
    best = {(0, 8): 0.1, (0, 64): 1.6, (0, 512): 6.4}
    fresh = plan_runs(seeds, "auto", planned, best)
    on = {r for r, a in fresh.items() if a.measures}
    assert on == {RunSpec(8, 0.1, 1).run_id, RunSpec(64, 3.2, 1).run_id,
                  RunSpec(512, 6.4, 1).run_id}
    # 0.2 at batch 8 is measured by seed 0 already: its seed-1 run stays off, and says why.
    assert "another run measures rate 0.2" in fresh[RunSpec(8, 0.2, 1).run_id].why


def test_the_folder_records_the_plan_once_and_a_worker_reads_its_run_with_it(tmp_path):
    """No process: the records written as a launch writes them, the plan recorded as
    `sweep.run_specs` records it, the runs read as a worker reads them."""
    from gnsweep import paths, store
    from gnsweep.config import SweepConfig
    from gnsweep.folder import SweepFolder, read_noise_plan
    from gnsweep.store import RunState
    from gnsweep.sweep import prepare

    config = Config(task=TaskConfig(name="digits"),
                    sweep=SweepConfig(batch_sizes=[8, 64], learning_rates=[0.1, 0.4, 1.6]))
    specs = prepare(tmp_path, config)
    begun = RunSpec(8, 0.1).run_id  # a run that began before any plan (an older version)
    store.write_status(paths.run_dir(tmp_path, begun), RunState.PENDING, attempts=1)
    folder = SweepFolder.of_config(tmp_path)
    plan = folder.plan_noise([s.run_id for s in specs])
    assert read_noise_plan(tmp_path) == plan and len(plan) == 6
    assert plan[begun].role == ALL and "began before" in plan[begun].why
    # The guess: 0.2 at batch 8 (0.1 and 0.4 tie), 0.8 at 64 (0.4 and 1.6 tie).
    assert {r for r, a in plan.items() if a.role == DENSE} == {
        RunSpec(b, lr).run_id for b, lr in ((8, 0.1), (8, 0.4), (64, 0.4), (64, 1.6))} - {begun}
    assert plan[RunSpec(64, 0.1).run_id].role == OFF
    before = (tmp_path / paths.NOISE_PLAN).read_bytes()
    assert folder.plan_noise([s.run_id for s in specs]) == plan  # decided once
    assert (tmp_path / paths.NOISE_PLAN).read_bytes() == before
    off, _ = folder.read_run(RunSpec(64, 0.1).run_id)
    on, _ = folder.read_run(RunSpec(64, 0.4).run_id)
    assert off.noise.method == "none" and on.noise.method == "auto"
    # A file gnsweep cannot have written: refused in one line naming it.
    (tmp_path / paths.NOISE_PLAN).write_text('{"runs": {"x": {"role": "sometimes"}}}')
    with pytest.raises(store.StoreError, match=r"noise_plan\.json: not a noise plan"):
        folder.read_run(RunSpec(64, 0.1).run_id)


def test_a_pooled_run_may_grow_its_variance_so_the_median_keeps_one_full_runs_error():
    # The median of n values each of variance g v: about pi g v / (2 n). At the growth
    # allowed that is 1.1^2 v: one run measured on every step, within 10%.
    for n in range(2, 40):
        g = pooled_variance_growth(n)
        assert g > 1 and math.pi * g / (2 * n) == pytest.approx(1.1 ** 2)
    assert pooled_variance_growth(1) == 1.0  # the run alone
    assert pooled_variance_growth(8) == pytest.approx(1.21 * 16 / math.pi)


def test_dense_runs_are_pooled_with_the_batch_sizes_whose_median_the_sweep_reads():
    batches = [8, 16, 32, 64, 128, 256, 512, 1024]
    specs = grid(batches=batches)
    plan = plan_runs(specs, "auto", {})
    dense = [a for a in plan.values() if a.role == DENSE]
    assert len(dense) == 16 and {a.pooled for a in dense} == {8}
    assert "median over 8 batch sizes" in summary(plan)
    assert {a.pooled for a in plan.values() if a.role == OFF} == {None}
    config = Config(task=TaskConfig(name="digits"))
    assert measured_as_planned(config, dense[0]).noise.pooled == 8
    assert config.noise.pooled == 1  # the sweep's own config is not changed
    # An explicit noise.every is the user's: not pooled.
    mine = plan_runs(specs, "auto", {}, every=1)
    assert len(measuring(mine)) == 16 and {a.pooled for a in mine.values()} == {None}
    # One batch size: the run alone, as configured.
    assert {a.pooled for a in plan_runs(grid(batches=[64]), "auto", {}).values()} == {None}
    # A record keeps its part; one written before runs were pooled reads as alone.
    assert Assignment.of(dense[0].as_dict()) == dense[0]
    assert Assignment.of({"role": "dense", "why": "x"}).pooled is None
    assert Assignment.of({"role": "dense", "why": "x", "pooled": 0}) is None
