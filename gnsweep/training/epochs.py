"""Global optimizer steps from a step counter that restarts every epoch.

Scripts print for a person: PyTorch's examples count batches within an epoch
(`| epoch 2 | 10/535 batches | ... | loss 6.10 |`). A run's rows count optimizer steps over the
whole run, so each epoch's counter is shifted by the steps of the epochs before it:

- with a `total` (the steps an epoch has, `535` above), epoch e starts after
  (e - first epoch) x total steps: exact;
- without one, epoch e starts after the previous epoch's last step *as logged*: exact when the
  script logs every step or the epoch's last one; a script that logs every k-th step may take
  up to k - 1 steps more than it logged, which `EpochSteps.step` says (once) in `notes`.

Pure: no file, no process. The reader of a script's log (`training.script_rows.RowLog`)
feeds every row through one `EpochSteps` per run, earlier attempts' rows first, so that an
attempt resumed in epoch 3 knows where epochs 1 and 2 ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class EpochError(ValueError):
    """A row whose epoch cannot be placed (an epoch after a gap, a total that changes)."""


@dataclass
class EpochSteps:
    """Each epoch's offset, learned as the rows arrive (`step`)."""

    offsets: dict[int, int] = field(default_factory=dict)
    """Epoch -> the global steps before its first."""
    last: dict[int, int] = field(default_factory=dict)
    """Epoch -> the largest step of it logged (the epoch's own counter)."""
    logged: dict[int, set[int]] = field(default_factory=dict)
    """Epoch -> its steps logged (fewer than `last`: the script logs every k-th step)."""
    first: int | None = None
    """The first epoch seen (its offset is 0)."""
    total: int | None = None
    notes: list[str] = field(default_factory=list)
    """What the caller should say: an offset that may be short (logged every k-th step)."""

    def step(self, epoch: int, local: int, total: int | None = None) -> int:
        """The global step of the row logged as step `local` of `epoch` (counted from 1 in
        the epoch, after any step offset). EpochError for an epoch that cannot be placed."""
        if total is not None:
            if total < 1:
                raise EpochError(f"total {total}: the steps an epoch has must be >= 1")
            if self.total is not None and total != self.total:
                raise EpochError(f"total {total} after total {self.total}: the steps an epoch "
                                 "has must not change within a run")
            self.total = total
        if self.first is None:
            self.first = epoch
        if epoch not in self.offsets:
            self.offsets[epoch] = self._offset(epoch)
        self.last[epoch] = max(self.last.get(epoch, 0), local)
        self.logged.setdefault(epoch, set()).add(local)
        return self.offsets[epoch] + local

    def _offset(self, epoch: int) -> int:
        assert self.first is not None
        if self.total is not None:
            if epoch < self.first:
                raise EpochError(f"epoch {epoch} before the run's first epoch {self.first}")
            return (epoch - self.first) * self.total
        if epoch == self.first:
            return 0
        before = [e for e in self.offsets if e < epoch]
        if not before:
            raise EpochError(f"epoch {epoch} before the run's first epoch {self.first}")
        previous = max(before)
        if previous != epoch - 1:
            raise EpochError(f"epoch {epoch} follows epoch {previous}: the steps of the epochs "
                             "between are unknown; give the steps an epoch has (a total group "
                             "or column)")
        last = self.last.get(previous, 0)
        logged = len(self.logged.get(previous, ()))
        if logged < last:
            self.notes.append(
                f"epoch {epoch} is taken to start after step {last} of epoch {previous}, its "
                f"last logged step ({logged} of its {last} steps logged): "
                "an epoch with more steps than that shifts every later step; give the steps "
                "an epoch has (a total group in task.log_pattern, a total column in the log "
                "file)")
        return self.offsets[previous] + last
