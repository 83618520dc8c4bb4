"""Answers that hold still, and say when they move: what runs an analysis covered, whether it
still covers every run on record, and each command's last answer with the runs it used.

An analysis records, in fits.json's meta `runs_used`, each run on record as `state:steps` read
before its rows were (a run that moves after that reads as newer than the analysis). `stale`
compares that with the folder now: `recommend`, `report` and `plot` analyse again where they
differ. `remember` keeps each command's last answer in DIR/answers.json (atomically), and says
what changed since the previous one, and why: runs added or finished, a target moved, a fit now
refused or bounded.
"""

from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Any

from gnsweep import store
from gnsweep.paths import SweepPaths, run_dir

ANSWER_KEYS = ("status", "target", "batch_size_samples", "learning_rate", "bcrit_status")
"""What makes two recommendations the same answer (the learning rate to 3 figures)."""


def runs_on_record(sweep_dir: Path) -> dict[str, str]:
    """Run id -> `state:steps` for every run folder (a run never started reads pending:0)."""
    out = {}
    for run_id in store.run_ids(sweep_dir):
        try:
            status = store.read_status(run_dir(sweep_dir, run_id))
        except store.StoreError:
            out[run_id] = "unreadable:0"
            continue
        out[run_id] = f"{status.state.value}:{status.steps or 0}"
    return out


def stale(sweep_dir: Path, meta: dict[str, Any]) -> str:
    """"" where the analysis (fits.json's meta) covers every run on record as it stands; else
    one clause saying what moved since."""
    used = meta.get("runs_used")
    if not isinstance(used, dict):
        return "it does not record the runs it used"
    return runs_moved(used, runs_on_record(sweep_dir))


def runs_moved(old: dict[str, str], new: dict[str, str]) -> str:
    """What moved between two `runs_on_record` ("" for nothing): runs added, gone, finished,
    or trained further."""
    parts = []
    added = sorted(set(new) - set(old))
    gone = sorted(set(old) - set(new))
    changed = sorted(r for r in set(old) & set(new) if old[r] != new[r])
    finished = [r for r in changed if new[r].split(":")[0] in ("done", "diverged", "failed")]
    moved = [r for r in changed if r not in finished]
    for runs, what in ((added, "new"), (finished, "finished since"),
                       (moved, "trained further or restarted since"), (gone, "gone")):
        if runs:
            names = ", ".join(runs[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
            parts.append(f"{len(runs)} run{'s' if len(runs) > 1 else ''} {what} ({names})")
    return "; ".join(parts)


def _same(old: dict[str, Any], new: dict[str, Any]) -> bool:
    for key in ANSWER_KEYS:
        a, b = old.get(key), new.get(key)
        if isinstance(a, float) and isinstance(b, float) and math.isfinite(a) and \
                math.isfinite(b):
            if f"{a:.3g}" != f"{b:.3g}":
                return False
        elif a != b:
            return False
    return True


def said(answer: dict[str, Any]) -> str:
    """An answer in a few words: 'fit at 0.5: batch 18 samples, lr 1.32'."""
    status, target = answer.get("status"), answer.get("target")
    text = f"{status}" + (f" at {target:g}" if isinstance(target, float | int) else "")
    if answer.get("batch_size_samples"):
        text += f": batch {answer['batch_size_samples']} samples"
        lr = answer.get("learning_rate")
        if isinstance(lr, float | int):
            text += f", lr {lr:.3g}"
    return text


def why_changed(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The reasons a later answer differs (pure): runs, the targets, the fits per target."""
    why = []
    moved = runs_moved(old.get("runs") or {}, new.get("runs") or {})
    if moved:
        why.append(moved)
    before, after = old.get("targets") or [], new.get("targets") or []
    if [f"{t:.4g}" for t in before] != [f"{t:.4g}" for t in after]:
        how = " (chosen automatically)" if new.get("targets_auto") else ""
        why.append(f"the targets moved from {', '.join(f'{t:g}' for t in before) or 'none'} to "
                   f"{', '.join(f'{t:g}' for t in after) or 'none'}{how}")
    fits_old, fits_new = old.get("fits") or {}, new.get("fits") or {}
    for target, now in fits_new.items():
        was = fits_old.get(target)
        if was is not None and was.get("status") != now.get("status"):
            reason = f" ({now['reason']})" if now.get("reason") else ""
            why.append(f"at {target} the fit was {was.get('status')} and is now "
                       f"{now.get('status')}{reason}")
    return why or ["the same runs and targets (a changed setting or version of the analysis)"]


def fits_summary(fits: Any) -> dict[str, dict[str, Any]]:
    """Per target (as text): its B_crit's status and reason, from a fits table."""
    out = {}
    for row in fits.itertuples(index=False):
        status = str(getattr(row, "bcrit_status", "") or "")
        reason = str(getattr(row, "bcrit_reason", "") or getattr(row, "refused", "") or "")
        if reason == "nan":
            reason = ""
        out[f"{float(row.target):g}"] = {"status": status, "reason": reason}
    return out


def remember(sweep_dir: Path, key: str, answer: dict[str, Any], meta: dict[str, Any],
             fits: Any) -> list[str]:
    """Record `key`'s answer (a recommendation's JSON) with the runs and targets it rests on in
    DIR/answers.json, atomically; returns the lines saying what changed since the previous
    answer under `key`, and why (none when it is the same, or the first)."""
    path = SweepPaths(sweep_dir).answers
    try:
        record = store.read_json(path) if path.is_file() else {}
    except store.StoreError:
        record = {}
    if not isinstance(record, dict):
        record = {}
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    entry: dict[str, Any] = {"at": now,
             "answer": {k: answer.get(k) for k in (*ANSWER_KEYS, "reason", "prefer")},
             "runs": meta.get("runs_used") or {},
             "targets": [float(t) for t in fits["target"]] if len(fits) else [],
             "targets_auto": str(meta.get("targets_auto") or ""),
             "fits": fits_summary(fits)}
    previous = record.get(key)
    record[key] = entry
    store.write_json(path, record)
    if not isinstance(previous, dict) or _same(previous.get("answer") or {}, entry["answer"]):
        return []
    return [f"the answer changed since the previous `gnsweep {key}` ({previous.get('at')}): "
            f"was {said(previous.get('answer') or {})}, now {said(entry['answer'])}; why: "
            + "; ".join(why_changed(previous, entry))]
