"""The layout of a sweep folder (`gnsweep.paths`): every name on disk is a public contract
(docs/storage.md, docs/scripts.md, docs/executors.md), written out here once; a path derived
differently would write files a user's tools and an older gnsweep do not find."""

from pathlib import Path

import pytest

from gnsweep.errors import StoreError
from gnsweep.paths import (
    RUN_WRITTEN_INTO,
    WRITTEN_INTO,
    OutPaths,
    SweepPaths,
    default_sweep_dir,
    run_dir,
)


def test_every_path_of_the_sweep_folder_is_the_documented_one(tmp_path):
    folder = SweepPaths(tmp_path)
    expected = {"config_file": "config.yaml", "runs_dir": "runs", "fits_json": "fits.json",
                "report": "report.html", "figures": "figures", "plan": "plan.json",
                "next_grids": "next_grids.json", "answers": "answers.json",
                "noise_plan": "noise_plan.json", "jobs": "slurm/jobs.json", "slurm": "slurm",
                "lock": ".claims.lock", "scale": "scale.json",
                "laws_family": "laws_family.json", "notices": ".notices", "queue": "queue",
                "tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
    assert {name: getattr(folder, name) for name in expected} == \
        {name: tmp_path / where for name, where in expected.items()}
    assert folder.result("steps") == tmp_path / "steps.parquet"
    assert folder.figures_of(None) == tmp_path / "figures"
    assert folder.figures_of("model=small") == tmp_path / "figures" / "model=small"
    assert sorted(p.name for p in folder.written_into) == sorted(WRITTEN_INTO)
    assert default_sweep_dir("tiny") == Path("runs") / "tiny"


def test_every_path_of_a_run_folder_is_the_documented_one(tmp_path):
    run = SweepPaths(tmp_path).run("b00008_lr0.3_s0")
    where = tmp_path / "runs" / "b00008_lr0.3_s0"
    assert run.folder == where and run.sweep == tmp_path
    expected = {"record": "config.json", "status": "status.json",
                "metrics": "metrics.parquet", "metric_parts": "metrics.parts",
                "history": "attempts.jsonl", "claim": "claim.json",
                "checkpoints": "checkpoints", "script_rows": "script_rows.jsonl",
                "noise_probe_rows": "noise_probe.jsonl", "script_stop": "stop",
                "script_process": "process.json"}
    assert {name: getattr(run, name) for name in expected} == \
        {name: where / name_on_disk for name, name_on_disk in expected.items()}
    assert run.script_output == (where / "stdout.log", where / "stderr.log")
    # Parts are named by their first and last step, padded so that the names sort in order.
    assert run.metric_part(7, 1234) == where / "metrics.parts" / "000000000007-000000001234.parquet"
    assert sorted(p.name for p in run.written_into) == sorted(RUN_WRITTEN_INTO)


def test_the_out_folder_of_compare_and_laws(tmp_path):
    out = OutPaths(tmp_path)
    assert (out.compare, out.laws, out.law_cells, out.laws_json, out.laws_html) == tuple(
        tmp_path / name for name in ("compare.parquet", "laws.parquet", "law_cells.parquet",
                                     "laws.json", "laws.html"))


@pytest.mark.parametrize("run_id", ["../elsewhere", "a/b", "", ".hidden", "x" * 200])
def test_a_run_id_that_is_not_one_folder_name_is_refused(tmp_path, run_id):
    with pytest.raises(StoreError, match="not a run id"):
        run_dir(tmp_path, run_id)


def test_a_linked_runs_folder_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "runs").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(StoreError, match="symbolic link"):
        run_dir(tmp_path, "b00008_lr0.3_s0")
