"""Every run of a sweep as `gnsweep status` and the live report show it: its state as the sweep
folder, its claims and Slurm's queue tell it, where it stands on disk, in the grid's order;
and what the runs measured (`sweep_measurement_note`, with the noise plan's lines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gnsweep import store
from gnsweep.folder import SweepFolder, read_noise_plan
from gnsweep.paths import SweepPaths, run_dir
from gnsweep.runs import measurement_note, read_state

UNFINISHED_SHOWN = ("running", "died", "pending", "queued")
"""States whose rows so far `gnsweep status` shows (step, examples, smoothed loss)."""


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

    # Run files checked against config.yaml, as every reader does.
    specs = SweepFolder.open(sweep_dir).specs
    submitted = job_ids(sweep_dir)
    queued = queue_states(list(submitted.values()))
    rows = []
    for run_id in sorted(store.run_ids(sweep_dir), key=lambda r: grid_order(r, specs)):
        path = run_dir(sweep_dir, run_id)
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


def grid_order(run_id: str, specs: dict[str, Any]) -> tuple[Any, ...]:
    """A run's place in the listing: by batch size, then learning rate, then seed, as numbers
    (lr5 before lr10 before lr20); a run without a spec after them, by its id."""
    spec = specs.get(run_id)
    if spec is None:
        return (1, 0.0, 0.0, 0, run_id)
    return (0, float(spec.batch_size), float(spec.learning_rate), int(spec.seed), run_id)


def sweep_measurement_note(sweep_dir: Path) -> str | None:
    """`measurement_note` from the runs' status.json files alone, and the noise plan's lines
    (`noise_plan_lines`): what `analyze` and `report` say beside their figures."""
    rows = [{"noise": store.read_status(run_dir(sweep_dir, run_id)).noise_measured}
            for run_id in store.run_ids(sweep_dir)]
    lines = [line for line in (measurement_note(rows), *noise_plan_lines(sweep_dir)) if line]
    return "\n".join(lines) or None


def noise_plan_lines(sweep_dir: Path, shown: int = 8) -> list[str]:
    """Which runs measure the noise scale and why (the folder's noise_plan.json,
    `gnsweep.noise_plan`): its summary, then the measuring runs by reason (`shown` ids at
    most); none where no plan is recorded."""
    from gnsweep.noise_plan import OFF, summary

    try:
        plan = read_noise_plan(sweep_dir)
    except store.StoreError as err:
        return [f"noise plan: unreadable ({err})"]
    if not plan:
        return []
    lines = [summary(plan)]
    measuring = sorted(r for r, a in plan.items() if a.role != OFF)
    if len(measuring) < len(plan):
        more = f" and {len(measuring) - shown} more" if len(measuring) > shown else ""
        lines.append(f"  measuring: {', '.join(measuring[:shown])}{more} "
                     f"({SweepPaths(sweep_dir).noise_plan.name} says why for each run)")
    return lines
