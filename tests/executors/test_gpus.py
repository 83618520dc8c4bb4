"""Sharing a machine's GPUs among a launcher's concurrent workers (`gnsweep.executors.gpus`).

The rule is checked by brute force over workers x GPUs x processes per worker; the launchers
for real (a forked local pool, torchrun jobs) on this CPU machine with an explicit
`executor.gpus` list: each worker sees the CUDA_VISIBLE_DEVICES it was given, and with CUDA
absent trains on the CPU.
"""

import json
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gnsweep import paths, store
from gnsweep.cli import app
from gnsweep.compose import compose
from gnsweep.config import ConfigError, ExecutorConfig
from gnsweep.executors.gpus import VISIBLE, assign, count_gpus, launcher_gpus, plan
from gnsweep.paths import HISTORY
from gnsweep.sweep import launch

QUICK = ["sweep=tiny", "sweep.batch_sizes=[8,16]", "sweep.learning_rates=[0.3,1.0]",
         "sweep.max_steps=40"]


@pytest.mark.parametrize("n_gpus", range(1, 9))
def test_each_worker_gets_distinct_gpus_disjoint_while_they_last_then_evenly_shared(n_gpus):
    gpus = [f"g{i}" for i in range(n_gpus)]
    for per_slot in range(1, n_gpus + 1):
        for slots in range(1, 10):
            shares = assign(gpus, slots, per_slot)
            assert len(shares) == slots
            for share in shares:  # a DDP job's ranks never share a GPU
                assert len(share) == per_slot == len(set(share))
                assert set(share) <= set(gpus)
            use = Counter(g for share in shares for g in share)
            if slots * per_slot <= n_gpus:  # enough GPUs: no two workers share one
                assert max(use.values()) == 1
                assert sum(use.values()) == slots * per_slot
            else:  # every GPU busy, none carrying two workers more than another
                assert set(use) == set(gpus)
                assert max(use.values()) - min(use.values()) <= 1


def test_a_worker_needing_more_gpus_than_there_are_is_refused():
    with pytest.raises(ValueError):
        assign(["0", "1"], 1, 3)
    with pytest.raises(ConfigError, match=r"nproc_per_node=4.*has 2.*at most 2"):
        plan(["0", "1"], 1, 4, what="torchrun job", setting="0,1")


def test_the_plan_gives_each_slot_its_environment_and_says_when_gpus_are_shared_or_idle():
    shared, note = plan(["4", "5"], 3, 1, what="worker", setting="auto")
    assert [shared.env(i) for i in range(3)] == [{VISIBLE: "4"}, {VISIBLE: "5"}, {VISIBLE: "4"}]
    assert note is not None and "3 workers share 2 GPUs" in note
    idle, note = plan(["0", "1", "2", "3"], 1, 2, what="torchrun job", setting="auto")
    assert idle.env(0) == {VISIBLE: "0,1"}
    assert note is not None and "uses 2 of the 4 GPUs" in note and "workers=2" in note
    # 3 GPUs a job on 4: a second job would share, not fill them, so none is suggested.
    _, note = plan(["0", "1", "2", "3"], 1, 3, what="torchrun job", setting="auto")
    assert note is not None and "uses 3 of the 4 GPUs" in note and "workers=" not in note
    assert plan(["0", "1"], 2, 1, what="worker", setting="auto")[1] is None  # one each
    hidden, _ = plan([], 2, 1, what="worker", setting="none")
    assert hidden.env(1) == {VISIBLE: ""}  # none: the workers see no GPU
    untouched, note = plan(None, 2, 1, what="worker", setting="auto")
    assert untouched.env(0) == {} and note is None  # no GPUs: the environment as it was


def test_auto_takes_the_launchers_own_visible_gpus_and_a_list_must_lie_within_them():
    def no_count() -> int:
        raise AssertionError("the launcher's CUDA_VISIBLE_DEVICES decides; nothing is counted")

    assert launcher_gpus("auto", {VISIBLE: "2,3"}, no_count) == ["2", "3"]
    assert launcher_gpus("auto", {VISIBLE: "GPU-a1,GPU-b2"}, no_count) == ["GPU-a1", "GPU-b2"]
    assert launcher_gpus("auto", {VISIBLE: ""}, no_count) is None  # sees none: left alone
    assert launcher_gpus("auto", {}, lambda: 3) == ["0", "1", "2"]
    assert launcher_gpus("auto", {}, lambda: 0) is None
    assert launcher_gpus("none", {VISIBLE: "2,3"}) == []
    assert launcher_gpus("3,1", {}) == ["3", "1"]
    assert launcher_gpus("3", {VISIBLE: "1,3"}) == ["3"]
    with pytest.raises(ConfigError, match=r"executor.gpus=0,3: 0 not among"):
        launcher_gpus("0,3", {VISIBLE: "1,3"})


def _nvidia_smi_gpus() -> int:
    """The machine's GPUs as nvidia-smi lists them (0 without it): the independent count."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


@pytest.mark.slow
def test_the_launcher_counts_the_gpus_nvidia_smi_lists():
    assert count_gpus() == _nvidia_smi_gpus()  # 0 here: no NVIDIA library, a CPU-only torch


@pytest.mark.skipif(_nvidia_smi_gpus() == 0, reason="needs NVIDIA GPUs")
def test_a_forked_worker_uses_cuda_after_the_launcher_counted_the_gpus():
    # In a fresh interpreter (this one may have used CUDA): count as the launcher does, fork,
    # give the child the last GPU, and use it there. Had counting initialised CUDA in the
    # parent, the child's first CUDA call would fail.
    code = textwrap.dedent("""
        import multiprocessing as mp, os
        import torch
        from gnsweep.executors.gpus import count_gpus
        n = count_gpus()
        def child(out):
            os.environ["CUDA_VISIBLE_DEVICES"] = str(n - 1)
            out.put((torch.cuda.device_count(), torch.ones(2, device="cuda").sum().item()))
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        ctx.Process(target=child, args=(out,)).start()
        print(n, *out.get(timeout=120), torch.cuda.is_initialized())
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(_nvidia_smi_gpus()), "1", "2.0", "False"]


@pytest.mark.parametrize(("value", "stored"), [
    ("auto", "auto"), ("NONE", "none"), (None, "none"), (3, "3"), ("0, 2", "0,2"),
    ([1, 0], "1,0"), (["GPU-5a", 2], "GPU-5a,2")])
def test_the_setting_is_stored_as_one_string(value, stored):
    assert ExecutorConfig(gpus=value).gpus == stored


@pytest.mark.parametrize(("value", "message"), [
    ("all", "is not auto, none or a list of GPU ids"), (-1, "is not auto, none"),
    ([], "is not auto, none"), (True, "is not auto, none"), ("0,0", "names a GPU twice"),
    (1.5, "is not auto, none")])
def test_a_bad_setting_is_refused_naming_it(value, message):
    with pytest.raises(ConfigError, match=message):
        ExecutorConfig(gpus=value)


def test_a_bad_setting_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    for override, said in [("executor.gpus=abc", "executor.gpus: 'abc' is not auto"),
                           ("executor.gpus=0,1", "executor.gpus=[0,1]"),
                           ("executor=slurm executor.gpus=[0]", "gpus_per_node")]:
        result = CliRunner().invoke(app, ["launch", *override.split(), "--sweep-dir",
                                          str(tmp_path / "s")])
        assert result.exit_code == 2, result.output
        assert said in result.output and "Traceback" not in result.output
    assert not (tmp_path / "s").exists()


def _where(sweep_dir: Path) -> dict[int, set[str]]:
    """The GPUs each worker pid was given, from the runs' status and start events."""
    from gnsweep.status_rows import sweep_status

    seen: dict[int, set[str]] = {}
    shown = {row["run_id"]: row for row in sweep_status(sweep_dir)}  # `gnsweep status`'s rows
    for run_id in store.run_ids(sweep_dir):
        path = paths.run_dir(sweep_dir, run_id)
        status = store.read_status(path)
        assert status["state"] in store.FINISHED, run_id
        assert status["device"] == "cpu"  # CUDA absent: trained on the CPU all the same
        seen.setdefault(int(status["pid"]), set()).add(status["gpus"])
        assert (shown[run_id]["gpus"], shown[run_id]["device"]) == (status["gpus"], "cpu")
        starts = [json.loads(line) for line in (path / HISTORY).read_text().splitlines()]
        assert [e["gpus"] for e in starts if e["event"] == "start"] == [status["gpus"]]
    return seen


@pytest.mark.slow
def test_a_local_pool_gives_each_worker_its_own_gpu(tmp_path):
    launch(compose([*QUICK, "executor.workers=2", "executor.gpus=[5,7]"]), tmp_path,
           show_progress=False)
    seen = _where(tmp_path)
    # The parent hands the first two runs to the two workers at once: both GPUs are used,
    # each by one worker, every run of a worker on that worker's GPU.
    assert all(len(gpus) == 1 for gpus in seen.values())
    assert sorted(g for gpus in seen.values() for g in gpus) == ["5", "7"]


@pytest.mark.slow
def test_a_worker_that_replaces_a_dead_one_takes_its_gpu(tmp_path, monkeypatch):
    from dying_task import MARKER

    from gnsweep import tasks
    from gnsweep.config import TaskConfig

    dying = tasks.TaskEntry(tasks.options.DigitsOptions, "dying_task:make", "dies once")
    monkeypatch.setitem(tasks.REGISTRY, "dying", dying)  # forked workers see it
    monkeypatch.setenv(MARKER, str(tmp_path / "died"))
    config = compose([*QUICK, "sweep.batch_sizes=[8]", "sweep.max_retries=1",
                      "executor.workers=1", "executor.gpus=[5,7]"])
    config.task = TaskConfig(name="dying")
    launch(config, tmp_path / "sweep", show_progress=False)
    assert (tmp_path / "died").exists()
    starts = [json.loads(line) for run_id in store.run_ids(tmp_path / "sweep")
              for line in (paths.run_dir(tmp_path / "sweep", run_id) / HISTORY).open()]
    starts = [e for e in starts if e["event"] == "start"]
    # The only worker died in its first run; its replacement (another pid) is on its GPU, 5,
    # not on the next one a fresh worker would have got.
    assert len({e["pid"] for e in starts}) == 2
    assert {e["gpus"] for e in starts} == {"5"}


@pytest.mark.distributed
def test_concurrent_torchrun_jobs_each_get_their_own_gpus(tmp_path):
    launch(compose([*QUICK, "executor=torchrun", "executor.nproc_per_node=2",
                    "executor.workers=2", "executor.gpus=[0,1,2,3]"]), tmp_path,
           show_progress=False)
    seen = _where(tmp_path)
    # Each job (its rank 0's pid) saw one share, and two jobs never the same one; which job
    # claims which run is a race, so one job may have trained them all.
    assert all(len(gpus) == 1 for gpus in seen.values())
    shares = [g for gpus in seen.values() for g in gpus]
    assert set(shares) <= {"0,1", "2,3"} and len(shares) == len(set(shares))
