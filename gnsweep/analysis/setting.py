"""What a user can set, and how the task counts: the unit of B (tokens for a language model),
task units per sample, the data-parallel size a batch must be a multiple of, and the grid that
ran. A recommendation (`analysis.decision`) and the next grid (`planner.next_grid`) say batch
sizes in these terms. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    """What the user can set and how the task counts: task units per sample (tokens a sequence;
    1 for a task counting samples), the data-parallel size the batch must be a multiple of, and
    the grid the sweep ran (samples per step, learning rates) for the next grid."""

    unit: str = "examples"
    per_sample: float = 1.0
    data_parallel: int = 1
    batch_sizes: tuple[int, ...] = ()
    learning_rates: tuple[float, ...] = ()

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Setting:
        """From fits.json's meta (`commands.analyze` records them); defaults where absent."""
        grid = meta.get("grid") or {}
        per = meta.get("per_sample")
        return cls(unit=str(meta.get("unit") or "examples"),
                   per_sample=float(per) if per and float(per) > 0 else 1.0,
                   data_parallel=max(int(meta.get("data_parallel") or 1), 1),
                   batch_sizes=tuple(int(b) for b in grid.get("batch_sizes") or ()),
                   learning_rates=tuple(float(x) for x in grid.get("learning_rates") or ()))

    @property
    def smallest(self) -> float:
        """The smallest batch a run can take, in the task's unit: one sample per process."""
        return self.data_parallel * self.per_sample

    def said(self, units: float) -> str:
        """A batch in words, singular where it is one: '1 example', '70 tokens (2 sequences)',
        '35 tokens (1 sequence)'."""
        text = counted(units, self.unit)
        if self.unit != "examples" and self.per_sample != 1.0:
            text += f" ({counted(units / self.per_sample, 'sequences')})"
        return text

    def samples(self, units: float) -> int:
        """Samples per step for `units` of the task's unit, rounded to the nearest multiple of
        the data-parallel size (at least one multiple)."""
        if not (math.isfinite(units) and units > 0):
            return 0
        dp = self.data_parallel
        return max(dp, dp * round(units / self.per_sample / dp))


def counted(value: float, unit: str) -> str:
    """'1 sequence', '2 sequences', '0.6 sequences': the unit singular only for exactly one."""
    if not math.isfinite(value):
        return f"? {unit}"
    number = f"{value:,.0f}" if abs(value) >= 10 or value == round(value) else f"{value:.2g}"
    return f"{number} {unit[:-1] if number == '1' and unit.endswith('s') else unit}"
