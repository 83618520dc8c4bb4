"""`gnsweep status`: every run's state as the sweep folder, its claims and Slurm's queue tell it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from gnsweep import store
from gnsweep.commands import Echo
from gnsweep.folder import SweepFolder
from gnsweep.runs import measurement_note, read_state, unmeasured_line

UNFINISHED_SHOWN = ("running", "died", "pending", "queued")
"""States whose rows so far `gnsweep status` shows (step, examples, smoothed loss)."""
ORDER = ("done", "diverged", "failed", "running", "queued", "pending", "died", "rerun",
         "unreadable")
"""The states in the summary line's order."""


def sweep_status(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row a run: id, state, attempts, Slurm job, owner, why it ended, how often Slurm
    requeued it (`requeues`), where its last attempt trained (`gpus`: the CUDA_VISIBLE_DEVICES
    it was given, `device`; None before its first), and where it stands on disk (`step`,
    `examples`, `loss_smooth` of its last row written; None before its first).

    A `running` run whose owner is gone shows as `died` (a relaunch runs it again); a pending
    run waiting in a Slurm queue shows as `queued`.
    """
    from gnsweep.executors import claims, requeues, unrecorded_error
    from gnsweep.executors.slurm import job_ids, queue_states

    SweepFolder.open(sweep_dir)  # run files checked against config.yaml, as every reader does
    submitted = job_ids(sweep_dir)
    queued = queue_states(list(submitted.values()))
    rows = []
    for run_id in store.run_ids(sweep_dir):
        path = store.run_dir(sweep_dir, run_id)
        status = read_state(path)
        state, job = status.state.value, status.slurm_job_id or submitted.get(run_id)
        if status.lost:
            state = "rerun"  # recorded finished, but its metrics are gone: a launch reruns it
        claim = claims.read_claim(path)
        owner = ""
        if state == "running":
            if claim is None or claims.is_stale(claim):
                state = "died"
            else:
                owner, job = f"{claim['host']}:{claim['pid']}", claim.get("slurm_job_id") or job
        elif state == "pending" and job and (queued.get(job) or queued.get(job.split("_")[0])):
            state = "queued"
        info = status.lost or status.error or status.reason or ""
        if state == "died":  # its end may be in its attempt log where status.json had no room
            info = unrecorded_error(path) or info
        # Where an unfinished run stands (a finished run's whole file is not read for it).
        last = store.last_metrics_row(path) if state in UNFINISHED_SHOWN else None
        rows.append({"run_id": run_id, "state": state, "attempts": status.attempts,
                     "slurm_job_id": job or "", "owner": owner, "info": str(info),
                     "requeues": requeues(path),
                     "gpus": status.gpus, "device": status.device,
                     "noise": status.noise_measured,
                     "b_simple_nan_share": status.b_simple_nan_share,
                     **{k: (last or {}).get(k) for k in ("step", "examples", "loss_smooth")}})
    for run_id, why in store.unreadable_runs(sweep_dir).items():
        # A folder of runs/ without a readable record: shown, never left out of the count.
        rows.append({"run_id": run_id, "state": "unreadable", "attempts": 0, "slurm_job_id": "",
                     "owner": "", "info": f"{why}; a relaunch writes it again",
                     "requeues": 0, "gpus": None, "device": None, "noise": None,
                     "b_simple_nan_share": None, "step": None, "examples": None,
                     "loss_smooth": None})
    return rows


def progress_of(row: dict[str, Any]) -> str:
    """Where an unfinished run stands on disk: step, examples, smoothed loss, the GPUs it is
    training on, requeues."""
    parts = []
    if row.get("step") is not None:
        loss = row.get("loss_smooth")
        shown = f"{loss:.4g}" if isinstance(loss, int | float) else "?"
        parts.append(f"step {row['step']}, {row['examples']} examples, loss {shown}")
    if row.get("gpus") and row["state"] == "running":
        parts.append(f"GPU {row['gpus']}")
    if row["requeues"]:
        parts.append(f"requeued {row['requeues']}x")
    return "; ".join(parts)


def run(sweep_dir: Path, all_runs: bool, echo: Echo) -> None:
    """`gnsweep status DIR [--all]`: one line a run not done (every run with --all), then the
    counts per state."""
    rows = sweep_status(sweep_dir)
    shown = [r for r in rows if all_runs or r["state"] != "done"]
    if shown:
        echo(f"{'run_id':<28}{'state':<10}{'tries':>5}  {'slurm job':<12}{'owner':<18}info")
    for r in shown:
        info = progress_of(r) or r["info"]
        info = info if len(info) <= 60 else info[:57] + "..."
        echo(f"{r['run_id']:<28}{r['state']:<10}{r['attempts']:>5}  "
             f"{r['slurm_job_id']:<12}{r['owner']:<18}{info}")
    counts = Counter(r["state"] for r in rows)
    requeued = sum(r["requeues"] for r in rows)
    echo(f"{len(rows)} runs: " + ", ".join(f"{counts[s]} {s}" for s in ORDER if counts[s])
         + (f"; Slurm requeued runs {requeued} times" if requeued else ""))
    note = measurement_note(rows)
    if note:
        echo(note)
    unmeasured = unmeasured_line({r["run_id"]: r["b_simple_nan_share"] for r in rows
                                  if r["state"] in ("done", "diverged")})
    if unmeasured:
        echo(unmeasured)
