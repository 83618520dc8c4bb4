"""Steps-to-target, best learning rates, sweeps and external tables, bad input.

Sweeps here are written by hand (real folders, real parquet files, no training) with loss curves
that reach each target at a step given by known laws, so the expected answers are mathematics.
"""

import json
import math

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from locations import ROOT
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.analysis.front import best_per_batch
from gnsweep.analysis.pipeline import analyze_tables
from gnsweep.analysis.steps import curves_from_frames, resmooth, steps_to_target
from gnsweep.cli import app
from gnsweep.noise import Ema
from gnsweep.sweep_analysis import analyze_sweep

runner = CliRunner()
OUTPUTS = ("steps.parquet", "front.parquet", "fits.parquet", "lr_fits.parquet",
           "loss_scaling.parquet", "fits.json")


def frames(curves: dict[str, list[float]], batch=8, states=None, **extra):
    """runs and metrics tables: one run per key, steps 1..n unless `step_<id>` is given."""
    runs, rows = [], []
    for run_id, losses in curves.items():
        runs.append({"run_id": run_id, "batch_size": batch, "learning_rate": 0.1, "seed": 0,
                     "state": (states or {}).get(run_id, "done")})
        steps = extra.get(f"step_{run_id}", range(1, len(losses) + 1))
        b_simple = extra.get(f"b_{run_id}", [math.nan] * len(losses))
        for step, loss, b in zip(steps, losses, b_simple, strict=True):
            rows.append({"run_id": run_id, "step": step, "loss": loss, "loss_smooth": loss,
                         "eval_loss": math.nan, "b_simple": b, "b_noise": math.nan})
    return pd.DataFrame(runs), pd.DataFrame(rows)


def one(steps, run_id, target):
    return steps[(steps["run_id"] == run_id) & (steps["target"] == target)].iloc[0]


def test_first_step_at_or_below_the_target():
    runs, metrics = frames({"a": [1.0, 0.8, 0.5, 0.49, 0.7]})
    steps = steps_to_target(metrics, runs, [0.5, 0.3], loss="raw")
    # The training loss logged at step 3 was computed before update 3: after 2 updates.
    assert one(steps, "a", 0.5)["steps"] == 2  # equality counts as reached
    assert one(steps, "a", 0.5)["examples"] == 16
    miss = one(steps, "a", 0.3)
    assert not miss["reached"] and math.isnan(miss["steps"]) and miss["outcome"] == "not_reached"
    assert miss["min_loss"] == 0.49 and miss["last_step"] == 5


def test_unreached_diverged_and_unfinished_runs_are_kept_and_marked():
    # 64 a step: a target met by the first update counts as one step (at 8 a step it is met
    # before the smoothing window holds 64 samples: outcome early, not counted).
    runs, metrics = frames({"ok": [0.4], "div": [0.1, 0.1]}, batch=64,
                           states={"div": "diverged"})
    runs = pd.concat([runs, pd.DataFrame([
        {"run_id": "p", "batch_size": 8, "learning_rate": 0.1, "seed": 0, "state": "pending"},
        {"run_id": "f", "batch_size": 8, "learning_rate": 0.1, "seed": 0, "state": "failed"},
        {"run_id": "x", "batch_size": 8, "learning_rate": 0.1, "seed": 0, "state": "corrupt"},
        {"run_id": "e", "batch_size": 8, "learning_rate": 0.1, "seed": 0, "state": "done"}])])
    steps = steps_to_target(metrics, runs, [0.5])
    outcome = dict(zip(steps["run_id"], steps["outcome"], strict=True))
    assert outcome == {"ok": "reached", "div": "diverged", "p": "pending", "f": "failed",
                       "x": "corrupt", "e": "no_metrics"}
    assert steps["reached"].tolist() == [True, False, False, False, False, False]


def test_rows_in_any_order_and_sparse_logging():
    runs, metrics = frames({"a": [0.9, 0.6, 0.45, 0.3]}, step_a=[10, 20, 30, 40])
    steps = steps_to_target(metrics.sample(frac=1, random_state=0), runs, [0.5, 0.35],
                            loss="raw")
    # Losses at 9, 19, 29, 39 updates; crossings interpolated linearly between logged rows.
    assert one(steps, "a", 0.5)["steps"] == pytest.approx(19 + 10 * 0.1 / 0.15)
    assert one(steps, "a", 0.35)["steps"] == pytest.approx(29 + 10 * 0.1 / 0.15)


def test_b_simple_at_target_and_its_smin_weighted_mean():
    # B = 10; rows at steps 1, 2, 3 with B_simple 10, 30, NaN. Weights dS/(1 + b/B): 1/2, 1/4.
    runs, metrics = frames({"a": [0.9, 0.8, 0.7]}, batch=10, b_a=[10.0, 30.0, math.nan])
    steps = steps_to_target(metrics, runs, [0.7], loss="raw")
    row = one(steps, "a", 0.7)
    assert row["b_simple_at_target"] == 30.0  # the last finite estimate
    assert row["b_simple_mean"] == pytest.approx((0.5 * 10 + 0.25 * 30) / 0.75)


def reference(metrics, runs, targets):
    """A plain loop over runs: the obvious implementation the vectorized one must match."""
    out = {}
    for run in runs.itertuples():
        rows = metrics[metrics["run_id"] == run.run_id].sort_values("step")
        for t in targets:
            hit = rows[rows["loss"] <= t]
            if run.state == "diverged" or hit.empty:
                out[run.run_id, t] = (math.nan, math.nan)
                continue
            # The raw loss of row i was taken after step_i - 1 updates; interpolated crossing.
            i = rows.index.get_loc(hit.index[0])
            x, v = rows["step"].to_numpy() - 1.0, rows["loss"].to_numpy()
            crossing = x[i] if i == 0 or v[i - 1] <= v[i] else \
                x[i - 1] + (v[i - 1] - t) / (v[i - 1] - v[i]) * (x[i] - x[i - 1])
            upto = rows[rows["step"] <= hit["step"].iloc[0]]
            ds = np.diff(np.concatenate([[0.0], upto["step"]]))
            b = upto["b_simple"].to_numpy()
            ok = np.isfinite(b) & (b > -run.batch_size)
            w = ds[ok] / (1 + b[ok] / run.batch_size)
            out[run.run_id, t] = (max(crossing, 1.0),  # never inside the first step
                                  (w * b[ok]).sum() / w.sum() if w.sum() > 0 else math.nan)
    return out


def test_vectorized_steps_match_a_plain_loop():
    rng = np.random.default_rng(0)
    runs, rows = [], []
    for i in range(30):
        n = int(rng.integers(0, 40))
        batch = int(rng.choice([4, 16, 64]))
        state = "diverged" if i % 7 == 3 else "done"
        runs.append({"run_id": f"r{i:02d}", "batch_size": batch, "learning_rate": 0.1,
                     "seed": 0, "state": state})
        loss = np.exp(-np.cumsum(rng.uniform(0, 0.2, n))) + rng.normal(0, 0.02, n)
        b = rng.normal(30, 40, n)
        b[rng.random(n) < 0.2] = np.nan
        rows += [{"run_id": f"r{i:02d}", "step": s + 1, "loss": v, "loss_smooth": v,
                  "eval_loss": np.nan, "b_simple": bb, "b_noise": np.nan}
                 for s, (v, bb) in enumerate(zip(loss, b, strict=True))]
    runs, metrics = pd.DataFrame(runs), pd.DataFrame(rows)
    targets = [0.8, 0.5, 0.2]
    steps = steps_to_target(metrics, runs, targets, loss="raw")
    expected = reference(metrics, runs, targets)
    for row in steps.itertuples():
        step, mean = expected[row.run_id, row.target]
        np.testing.assert_allclose([row.steps, row.b_simple_mean], [step, mean], rtol=1e-9)


def test_resmoothing_is_the_training_loops_ema():
    runs, metrics = frames({"a": [1.0, 0.5, 0.8, 0.2, 0.4]}, batch=16)
    curves = curves_from_frames(runs, metrics)
    ema, expected = Ema(), []
    for v in [1.0, 0.5, 0.8, 0.2, 0.4]:
        ema.update(v, math.exp(-16 / 64))
        expected.append(ema.value)
    np.testing.assert_allclose(resmooth(curves, 64.0), expected, rtol=1e-12)


def test_best_learning_rate_warnings_for_edges_and_single_learning_rates():
    rows = []
    for b, lrs_steps in ((8, {0.1: 50, 0.3: 40, 1.0: 60}), (32, {0.1: 30, 0.3: 20, 1.0: 10}),
                         (128, {0.1: math.nan, 0.3: 8, 1.0: math.nan})):
        for lr, s in lrs_steps.items():
            rows.append({"run_id": f"{b}_{lr}", "batch_size": b, "learning_rate": lr, "seed": 0,
                         "target": 0.5, "reached": not math.isnan(s), "steps": s,
                         "b_simple_at_target": np.nan, "b_simple_mean": np.nan})
    best = best_per_batch(pd.DataFrame(rows)).set_index("batch_size")
    assert best.loc[8, "learning_rate"] == 0.3 and not best.loc[8, "lr_on_edge"]
    assert 0.1 < best.loc[8, "lr_opt"] < 1.0
    assert best.loc[32, "lr_edge"] == "high" and best.loc[32, "lr_opt"] == 1.0
    assert best.loc[128, "n_lr_reached"] == 1
    analysis = analyze_tables(None, curves_from_frames(*frames({"a": [0.1]}, batch=64)), [0.5])
    assert analysis.fits.iloc[0]["refused"]  # one batch size: refused, with the reason
    from gnsweep.analysis.pipeline import _grid_warnings
    text = " | ".join(_grid_warnings(best.reset_index()))
    assert "batch 32: best learning rate 1 is on the high edge" in text
    assert "batch 128: only 1 learning rate reached" in text


def test_a_seed_that_misses_disqualifies_its_grid_point():
    rows = [{"run_id": f"s{s}_{lr}", "batch_size": 8, "learning_rate": lr, "seed": s,
             "target": 0.5, "reached": reached, "steps": steps, "b_simple_at_target": np.nan,
             "b_simple_mean": np.nan}
            for s, lr, reached, steps in ((0, 0.1, True, 10), (1, 0.1, False, np.nan),
                                          (0, 0.3, True, 20), (1, 0.3, True, 30))]
    best = best_per_batch(pd.DataFrame(rows)).iloc[0]
    assert best["learning_rate"] == 0.3 and best["steps"] == 25 and best["n_seeds"] == 2


# ---- whole sweeps on disk ------------------------------------------------------------

TRUTH = {1.0: (40.0, 2_560.0), 0.5: (100.0, 9_600.0)}  # target -> (S_min, E_min)
BATCHES = (4, 16, 64, 256, 1024)
# eps_opt(B) = 2/(1 + 64/B) of every batch size, and one learning rate beyond either end.
LRS = (0.05, *(2.0 / (1 + 64 / b) for b in BATCHES), 4.0)


def steps_needed(target, batch, lr):
    """Steps to reach `target`: S_min + E_min/B at eps_opt(B) = 2/(1 + 64/B), a bowl around it."""
    s_min, e_min = TRUTH[target]
    best = 2.0 / (1 + 64 / batch)
    return (s_min + e_min / batch) * math.exp(0.3 * math.log(lr / best) ** 2)


def write_sweep(root, *, corrupt=None, b_simple=50.0):
    """A sweep folder by hand: config.yaml, run configs, statuses and metrics files whose loss
    falls log-linearly through each target at the step given by `steps_needed`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump({
        "sweep": {"targets": list(TRUTH)}, "train": {"optimizer": "sgd"},
        "analysis": {"loss": "smoothed", "bootstrap": 0}}))
    (root / "runs").mkdir(exist_ok=True)
    for b in BATCHES:
        for lr in LRS:
            run_id = f"b{b:05d}_lr{lr:g}_s0"
            path = paths.run_dir(root, run_id)
            store.write_json(path / paths.RUN_CONFIG, {"run": {
                "batch_size": b, "learning_rate": lr, "seed": 0}})
            knots = [(0.0, math.log(2.0))] + [(steps_needed(t, b, lr), math.log(t))
                                              for t in (1.0, 0.5)]
            last = int(knots[-1][0]) + 5
            step = np.arange(1, last + 1, dtype=float)
            log_loss = np.interp(step, [k[0] for k in knots], [k[1] for k in knots],
                                 right=math.log(0.49))
            n = len(step)
            rows = {f.name: [math.nan] * n for f in store.METRICS_SCHEMA}
            rows.update(step=step.astype(int).tolist(), examples=(step * b).astype(int).tolist(),
                        loss=np.exp(log_loss).tolist(), loss_smooth=np.exp(log_loss).tolist(),
                        b_simple=[b_simple] * n)
            store.write_table(path / paths.METRICS, store.metrics_table(rows))
            store.write_status(path, "done")
    if corrupt:
        (paths.run_dir(root, corrupt) / paths.METRICS).write_bytes(b"PAR1 not really")
    return root


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return write_sweep(tmp_path_factory.mktemp("sweep") / "s")


def test_a_sweep_on_disk_recovers_its_laws(sweep):
    analysis = analyze_sweep(sweep, write=False)
    fits = analysis.fits.set_index("target")
    for target, (s_min, e_min) in TRUTH.items():
        row = fits.loc[target]
        # Steps are whole logged steps, so the points sit within one step of the law.
        assert row["s_min"] == pytest.approx(s_min, rel=0.05)
        assert row["b_crit"] == pytest.approx(e_min / s_min, rel=0.08)
        assert row["b_simple_mean"] == pytest.approx(50.0)
        assert row["ratio"] == pytest.approx(row["b_crit"] / 50.0)
        assert row["lr_refused"] == ""
        # Whole steps flatten the bowl's bottom (1.6 vs 1.88 differ by < 1%), so lr_opt is
        # only located to a few percent.
        assert row["b_noise_lr"] == pytest.approx(64.0, rel=0.15)
    scaling = analysis.loss_scaling.iloc[0]
    expected_slope = math.log(TRUTH[0.5][1] / TRUTH[0.5][0] / (TRUTH[1.0][1] / TRUTH[1.0][0]))
    assert -1 / scaling["alpha_b"] == pytest.approx(-expected_slope / math.log(2), rel=0.2)


def test_cli_writes_every_table_and_json(sweep, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["analyze", str(sweep), "--out", str(out), "--json",
                                 "--bootstrap", "50"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {f["target"] for f in data["fits"]} == set(TRUTH)
    assert data["fits"][0]["n_bootstrap"] == 50 and data["meta"]["loss"] == "smoothed"
    for name in OUTPUTS:
        assert (out / name).is_file(), name
    front = pq.read_table(out / "front.parquet").to_pandas()
    assert front["on_front"].all() and front["resid_log"].abs().max() < 0.1
    steps = pq.read_table(out / "steps.parquet").to_pandas()
    assert len(steps) == len(BATCHES) * len(LRS) * len(TRUTH)


def test_corrupt_metrics_exit_2_naming_the_file_and_write_nothing(tmp_path):
    sweep = write_sweep(tmp_path / "s", corrupt="b00016_lr1_s0")
    result = runner.invoke(app, ["analyze", str(sweep)])
    assert result.exit_code == 2
    assert "b00016_lr1_s0/metrics.parquet" in result.stderr and "Traceback" not in result.output
    assert not any((sweep / name).exists() for name in OUTPUTS)
    result = runner.invoke(app, ["analyze", str(sweep), "--skip-corrupt"])
    assert result.exit_code == 0, result.output
    steps = pq.read_table(sweep / "steps.parquet").to_pandas()
    assert set(steps.loc[steps["run_id"] == "b00016_lr1_s0", "outcome"]) == {"corrupt"}


def test_empty_sweep_and_unreached_target_exit_2(tmp_path):
    empty = tmp_path / "empty"
    (empty / "runs").mkdir(parents=True)
    (empty / "config.yaml").write_text("sweep: {targets: [0.5]}\n")
    result = runner.invoke(app, ["analyze", str(empty)])
    assert result.exit_code == 2 and "no runs" in result.stderr
    sweep = write_sweep(tmp_path / "s")
    result = runner.invoke(app, ["analyze", str(sweep), "--targets", "0.01"])
    assert result.exit_code == 2
    assert "target 0.01: no run reached it" in result.stderr and "--targets auto" in result.stderr
    assert not any((sweep / name).exists() for name in OUTPUTS)
    # One target out of reach leaves the others analysed, and says so.
    result = runner.invoke(app, ["analyze", str(sweep), "--targets", "0.5,0.01"])
    assert result.exit_code == 0, result.output
    assert "warning: target 0.01: no run reached it (lowest loss 0.49" in result.stderr
    assert "left out, the other targets are analysed" in result.stderr
    assert list(pq.read_table(sweep / "fits.parquet").to_pandas()["target"]) == [0.5]


# ---- tables made elsewhere -----------------------------------------------------------


def test_example_steps_table_recovers_its_truth(tmp_path):

    example = ROOT / "docs" / "examples" / "steps.csv"
    result = runner.invoke(app, ["analyze", "--table", str(example), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    fits = pq.read_table(tmp_path / "fits.parquet").to_pandas().set_index("target")
    # docs/examples/make_steps.py: B_crit 40 at loss 2, 64 at 1.5; B_noise 50; 3% noise.
    for target, b_crit in ((2.0, 40.0), (1.5, 64.0)):
        row = fits.loc[target]
        assert abs(row["b_crit"] - b_crit) < 4 * row["b_crit_se"]
        assert abs(row["b_noise_lr"] - 50.0) < 4 * row["b_noise_lr_se"]


def test_loss_curve_table_as_csv_and_parquet(sweep, tmp_path):
    from gnsweep.folder import load_sweep

    runs, metrics = load_sweep(sweep)
    table = metrics.merge(runs, on="run_id")[
        ["run_id", "batch_size", "learning_rate", "step", "loss", "b_simple"]]
    expected = analyze_sweep(sweep, "raw", write=False).fits.set_index("target")["b_crit"]
    for name in ("curves.csv", "curves.parquet"):
        path = tmp_path / name
        if name.endswith("csv"):
            table.to_csv(path, index=False)
        else:
            table.to_parquet(path)
        out = tmp_path / f"out_{name}"
        # --loss raw: the table's loss is the curve itself, no smoothing.
        result = runner.invoke(app, ["analyze", "--table", str(path), "--out", str(out),
                                     "--targets", "1,0.5", "--loss", "raw"])
        assert result.exit_code == 0, result.output
        fits = pq.read_table(out / "fits.parquet").to_pandas().set_index("target")["b_crit"]
        pd.testing.assert_series_equal(fits, expected, rtol=1e-9)


def write_csv(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    ("batch_size,target\n8,0.5\n", "missing column(s) steps"),
    ("batch_size,target,steps\n8,0.5,10\n16,0.5,\n", "column 'steps'"),
    ("batch_size,target,steps\n8,0.5,10\n16,0.5,-3\n", "must be > 0 (row(s) 3)"),
    ("batch_size,target,steps\n8,0.5,ten\n", "'ten' is not a number"),
    ("run_id,batch_size,step,loss\na,8,1,0.3\n", "missing column(s) learning_rate"),
    ("batch_size,target,steps\n", "no rows"),
    ("run_id,batch_size,learning_rate,step,loss\na,8,0.1,1,0.3\n", "needs --targets"),
])
def test_bad_tables_exit_2_naming_the_column(tmp_path, text, message):
    path = write_csv(tmp_path / "t.csv", text)
    out = tmp_path / "out"
    result = runner.invoke(app, ["analyze", "--table", str(path), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and str(path) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_unreadable_tables_exit_2(tmp_path):
    for name, content in (("t.parquet", b"PAR1garbage"), ("t.xlsx", b"x"), ("t.csv", None)):
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        result = runner.invoke(app, ["analyze", "--table", str(path), "--out",
                                     str(tmp_path / "o")])
        assert result.exit_code == 2 and name in result.stderr, result.output
    curves = write_csv(tmp_path / "c.csv", "run_id,batch_size,learning_rate,step,loss\n"
                                           "a,8,0.1,1,0.9\na,8,0.1,2,0.6\n")
    result = runner.invoke(app, ["analyze", "--table", str(curves), "--out",
                                 str(tmp_path / "o"), "--targets", "0.1", "--loss", "raw"])
    assert result.exit_code == 2 and "target 0.1: no run reached it" in result.stderr
    assert not (tmp_path / "o").exists()


def test_b_noise_flows_to_the_fits_when_measured():
    runs, metrics = frames({"a": [0.9, 0.4]}, batch=10)
    metrics["b_noise"] = [20.0, 20.0]
    rows = steps_to_target(metrics, runs, [0.5], loss="raw")  # met at 1 update: 10 samples
    assert rows.iloc[0]["b_noise_at_target"] == 20.0 and rows.iloc[0]["b_noise_mean"] == 20.0
    steps = pd.concat([rows.assign(batch_size=b, steps=100 + 6400 / b, run_id=f"r{b}")
                       for b in (8, 32, 128, 512)])
    from gnsweep.analysis.pipeline import analyze_steps

    fit = analyze_steps(steps, [0.5]).fits.iloc[0]
    assert fit["b_crit"] == pytest.approx(64.0, rel=1e-6)
    assert fit["ratio_noise"] == pytest.approx(64.0 / 20.0, rel=1e-6)
    assert math.isnan(fit["ratio"])  # B_simple was not measured: NaN, not a made-up figure


def test_json_has_no_nan_and_ema_examples_needs_the_smoothed_loss(sweep, tmp_path):
    result = runner.invoke(app, ["analyze", str(sweep), "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0 and "NaN" not in result.stdout
    json.loads(result.stdout)
    result = runner.invoke(app, ["analyze", str(sweep), "--loss", "raw", "--ema-examples", "64"])
    assert result.exit_code == 2 and "--ema-examples" in result.stderr


@pytest.mark.process
def test_analysis_never_imports_torch(tmp_path):
    """People analyze on laptops without torch: a whole table analysis must not import it."""
    import subprocess
    import sys

    example = ROOT / "docs" / "examples" / "steps.csv"
    code = ("import sys\nfrom pathlib import Path\n"
            "from gnsweep.analysis.external import analyze_table\n"
            "from gnsweep.analysis import baseline, load\n"
            "from gnsweep import sweep_analysis\n"
            f"sweep_analysis.write_outputs(Path({str(tmp_path)!r}), "
            f"analyze_table(Path({str(example)!r}), bootstrap=10))\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
