"""The decision an analysis supports: the batch size and learning rate to train with, what they
cost, and the tradeoff around them. Pure: `Results` in, a `Recommendation` out; no files.

Eq. 2.11 with E = B S: training at batch size B to a target costs

    S(B) = S_min (1 + B_crit/B) steps and E(B) = E_min (1 + B/B_crit) examples,

so B = B_crit (`balanced`) costs 2 S_min and 2 E_min; `time` takes PREFERENCES["time"] x B_crit
(S within 25% of S_min, at 5 E_min) and `compute` PREFERENCES["compute"] x B_crit (E within 25%
of E_min, at 5 S_min). The batch size is said in the task's unit and in samples per step,
rounded to a multiple of the data-parallel size (what a user can set). Where the preference's
multiple of B_crit lies below the smallest batch a run can take (one sample per process) the batch
is that smallest one, `clipped` says so, and its costs are eq. 2.11's there, not the preference's.

The learning rate at that batch size comes from the eq. 2.7 fit of the best learning rates
(`analysis.lr`, the fits row's model) only where that fit stands and the batch size lies inside
the batch sizes it was fitted on (interpolation); else from the measured best rates of the two
batch sizes around it; else it is a bound or nothing, with the reason. Its interval is the lr
fit's 95% interval at that batch size (delta method, or a residual bootstrap when the analysis
was bootstrapped); the batch size's interval is B_crit's (bootstrap or delta method) times the
preference's multiple, rounded to batch sizes a run can take as the batch size is (so it always
contains it).

B_crit below the smallest batch a run can take, and no smaller one to measure: every batch from
that size up takes about S_min steps (S = S_min (1 + B_crit/B) with B_crit/B < 1), so a larger
batch buys almost no steps; that smallest batch, at its measured best learning rate, is the
answer (status `fit`, `bcrit_status` `below_smallest`) and the choice above it is throughput's.

Status: `fit` (B from a well-determined B_crit, the learning rate interpolated), `bound` (B_crit
only bounded, extrapolated, fitted on fewer than MIN_BATCH_SIZES batch sizes, or the learning
rate not placed inside the grid: then `next_grid` says what to run, `planner.next_grid`; or a
loss target that was not analysed, read off B_crit(L)), `refused` (no target supports any
answer).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from gnsweep import lr_law
from gnsweep.analysis.bounds import FIT, LOWER_BOUND, UPPER_BOUND
from gnsweep.analysis.fit import FitRefused
from gnsweep.analysis.lr import fit_lr
from gnsweep.analysis.results import Results
from gnsweep.analysis.setting import Setting
from gnsweep.planner.next_grid import NextGrid, next_grid
from gnsweep.targets import Direction

PREFERENCES = {"time": 4.0, "balanced": 1.0, "compute": 0.25}
"""B / B_crit per preference: balanced is the paper's B = B_crit (2 S_min, 2 E_min, eq. 2.11);
time 4 B_crit (S = 1.25 S_min, E = 5 E_min); compute B_crit / 4 (S = 5 S_min, E = 1.25 E_min)."""
TRADEOFF_MULTIPLES = (0.25, 0.5, 1.0, 2.0, 4.0)
"""The tradeoff table's batch sizes, in units of B_crit."""
MIN_BATCH_SIZES = 4
"""A B_crit fitted on fewer batch sizes is not settled: the recommendation is a bound with a
next grid (`well_determined`'s `thin`)."""
WELL_DETERMINED = 0.5
"""A fitted B_crit whose standard error exceeds this share of it is poorly determined (the
analysis's `quality` says so): no recommendation is made from it."""
Z95 = 1.959964
"""Two-sided 95% normal quantile (intervals on the log scale)."""
MAX_LR_BOOTSTRAP = 200
"""Residual-bootstrap refits of the learning-rate fit at most (when the analysis bootstraps)."""
FIT_STATUS, BOUND_STATUS, REFUSED_STATUS = "fit", "bound", "refused"
NOT_MEASURED = "not_measured"
"""`lr_status` where the measurements carry no learning rate (a steps table of tuned points):
the batch size is still the answer; the learning rate is the user's own."""
STATUSES = (FIT_STATUS, BOUND_STATUS, REFUSED_STATUS)


@dataclass
class Recommendation:
    """One decision. JSON fields (`to_json`) are the public contract: batch_size (task unit),
    batch_size_samples, learning_rate, learning_rate_low, learning_rate_high, steps, examples,
    target, status (fit / bound / refused) and next_grid (when a bound)."""

    status: str
    target: float | None
    prefer: str
    reason: str = ""
    """Why a bound or refused ("" for a fit)."""
    unit: str = "examples"
    per_sample: float = 1.0
    data_parallel: int = 1
    multiple: float = 1.0
    """B / B_crit of the preference."""
    batch_size: float = math.nan
    """In the task's unit (tokens for a language model), after rounding to samples."""
    batch_size_samples: int = 0
    batch_size_low: float = math.nan
    batch_size_high: float = math.nan
    """The preference's multiple of B_crit's 95% interval (task unit)."""
    bcrit_status: str = ""
    """B_crit's own verdict: fit (well determined), thin (fitted on too few batch sizes to
    settle it: the setting is the fit's, the status a bound), bound (only bounded or
    extrapolated) or law (a target not analysed, through B_crit(L))."""
    batch_size_preferred: float = math.nan
    """The preference's multiple of B_crit before rounding (task unit)."""
    smallest: float = math.nan
    """The smallest batch a run can take (task unit): one sample per process."""
    clipped: bool = False
    """The preferred batch lies below `smallest`: the batch is `smallest`, its costs eq. 2.11's
    there (not the preference's)."""
    batch_size_side: str = ""
    """For a bound: "at_least" (B_crit above the grid) or "at_most" (below it)."""
    b_crit: float = math.nan
    b_crit_low: float = math.nan
    b_crit_high: float = math.nan
    s_min: float = math.nan
    e_min: float = math.nan
    learning_rate: float = math.nan
    learning_rate_low: float = math.nan
    learning_rate_high: float = math.nan
    lr_status: str = ""
    """fit (eq. 2.7 fit, inside its batch sizes), interpolated (between two measured best
    rates), measured (the grid's best at that batch size), lower_bound / upper_bound (the best
    rate on the grid's edge), not_measured (the measurements carry no learning rate),
    refused."""
    lr_reason: str = ""
    steps: float = math.nan
    examples: float = math.nan
    """Steps and examples (task unit) to the target at `batch_size`: eq. 2.11 for a fit, the
    measured ones for a bound."""
    steps_over_min: float = math.nan
    examples_over_min: float = math.nan
    tradeoff: list[dict[str, float]] = field(default_factory=list)
    next_grid: NextGrid | None = None
    launch: str = ""
    """Overrides that paste into the next `gnsweep launch`."""

    @property
    def in_tokens(self) -> bool:
        return self.unit != "examples" and self.per_sample != 1.0

    def to_json(self) -> dict[str, Any]:
        out = {k: _plain(v) for k, v in asdict(self).items()
               if k not in ("next_grid", "tradeoff")}
        out["tradeoff"] = [{k: _plain(v) for k, v in row.items()} for row in self.tradeoff]
        out["next_grid"] = self.next_grid.to_json() if self.next_grid is not None else None
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def tradeoff(b_crit: float, s_min: float, e_min: float, setting: Setting,
             multiples: tuple[float, ...] = TRADEOFF_MULTIPLES) -> list[dict[str, float]]:
    """Eq. 2.11 at `multiples` x B_crit: each row's batch size (task unit, and samples rounded
    as `Setting.samples`), steps S_min (1 + B_crit/B) and examples E_min (1 + B/B_crit) at the
    rounded batch size, and both relative to their minimum. `b_over_bcrit` is the rounded
    batch's own multiple; multiples that round to one batch (below the smallest a run can take)
    give one row, the first."""
    rows = []
    seen: set[int] = set()
    for m in multiples:
        samples = setting.samples(m * b_crit)
        if samples in seen:
            continue
        seen.add(samples)
        b = samples * setting.per_sample
        steps = s_min * (1 + b_crit / b)
        examples = e_min * (1 + b / b_crit)
        rows.append({"multiple": m, "b_over_bcrit": b / b_crit, "batch_size": b,
                     "batch_size_samples": samples,
                     "steps": steps, "examples": examples, "steps_over_min": steps / s_min,
                     "examples_over_min": examples / e_min})
    return rows


def log_interval(value: float, se: float) -> tuple[float, float]:
    """95% interval symmetric on the log scale (value positive, error by the delta method)."""
    if not (math.isfinite(value) and value > 0 and math.isfinite(se) and se >= 0):
        return math.nan, math.nan
    spread = math.exp(min(Z95 * se / value, 700.0))
    return value / spread, value * spread


def bcrit_interval(row: Any) -> tuple[float, float]:
    """B_crit's 95% interval: bootstrap percentiles where the analysis made them, else the
    delta method's on log B_crit."""
    lo, hi = float(row.get("b_crit_lo", math.nan)), float(row.get("b_crit_hi", math.nan))
    if math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi:
        return lo, hi
    return log_interval(float(row["b_crit"]), float(row["b_crit_se"]))


def well_determined(row: Any, front: pd.DataFrame) -> tuple[str, str]:
    """Whether a fits row can give a recommendation as a fit: ("", "") when it can, else the
    kind and the reason: `bound` (the analysis only bounds B_crit), `extrapolated` (a fitted
    B_crit outside the batch sizes fitted), `thin` (fewer than MIN_BATCH_SIZES batch sizes: a
    hyperbola through 3 points of one seed and a coarse learning-rate grid can sit a factor of
    a few from the truth with a small error), `refused` (no fit, or a standard error above
    WELL_DETERMINED of B_crit: poorly determined)."""
    status = str(row.get("bcrit_status", ""))
    if status in (LOWER_BOUND, UPPER_BOUND):
        return "bound", str(row.get("bcrit_reason", "") or row.get("refused", ""))
    if status != FIT or str(row.get("refused", "") or ""):
        return "refused", str(row.get("bcrit_reason", "") or row.get("refused", "") or "no fit")
    b_crit, se = float(row["b_crit"]), float(row["b_crit_se"])
    if not (math.isfinite(b_crit) and b_crit > 0):
        return "refused", "no fitted B_crit"
    if not math.isfinite(se) or se > WELL_DETERMINED * b_crit:
        return "refused", ((f"B_crit {b_crit:.4g} is poorly determined (standard error "
                            f"{se / b_crit:.0%} of it" if math.isfinite(se) else
                            f"B_crit {b_crit:.4g} has no standard error (")
                           + "); more batch sizes or seeds")
    low, high = _support(front, float(row["target"]))
    if math.isfinite(low) and not low <= b_crit <= high:
        side = "above the largest" if b_crit > high else "below the smallest"
        return "extrapolated", (f"B_crit {b_crit:.4g} lies {side} batch size fitted ({low:g}.."
                                f"{high:g}): an extrapolation, the sweep only bounds it")
    n = int(row.get("n_batch_sizes", 0) or 0)
    if n < MIN_BATCH_SIZES:
        return "thin", (f"B_crit {b_crit:.4g} rests on only {n} batch sizes; a fit of eq. "
                        f"2.11 needs at least {MIN_BATCH_SIZES} to settle it")
    return "", ""


def side_of(row: Any, front: pd.DataFrame, kind: str) -> str | None:
    """Where the next grid adds batch sizes: "above" or "below" the grid for a B_crit that is
    a bound, extrapolated, or thin (the side of the grid's middle it lies on); None where
    B_crit is settled (only learning rates are added)."""
    status = str(row.get("bcrit_status", ""))
    if kind == "bound":
        return "above" if status == LOWER_BOUND else "below"
    b_crit = float(row.get("b_crit", math.nan))
    low, high = _support(front, float(row["target"]))
    if kind == "extrapolated":
        return "above" if b_crit > high else "below"
    if kind == "thin":
        return "above" if b_crit >= math.sqrt(low * high) else "below"
    return None


def _support(front: pd.DataFrame, target: float) -> tuple[float, float]:
    rows = _target_rows(front, target)
    if "in_fit" in rows:
        rows = rows[rows["in_fit"].astype(bool)]
    if not len(rows):
        return math.nan, math.nan
    return float(rows["batch_size"].min()), float(rows["batch_size"].max())


def _target_rows(frame: pd.DataFrame, target: float) -> pd.DataFrame:
    if not len(frame) or "target" not in frame:
        return frame.iloc[0:0]
    return frame[np.isclose(frame["target"].astype(float), target, rtol=1e-9, atol=0)]


def choose_target(results: Results, target: float | None = None
                  ) -> tuple[Any, tuple[str, str]]:
    """The fits row to recommend from: `target` when given (KeyError naming the analysed ones
    when it was not analysed), else the hardest target (last in training order) whose B_crit is
    well determined, else the hardest that a next grid can settle (thin, extrapolated or a
    bound). Returns (row, `well_determined`'s kind and reason)."""
    fits = results.fits
    if target is not None:
        rows = _target_rows(fits, target)
        if not len(rows):
            analysed = ", ".join(f"{t:g}" for t in fits["target"])
            raise KeyError(f"target {target:g} was not analysed (analysed: {analysed}); "
                           f"analyze it first: gnsweep analyze DIR --targets ...")
        row = rows.iloc[0]
        return row, well_determined(row, results.front)
    order = Direction.from_meta(results.meta).in_training_order(list(fits["target"]))
    by_target = {float(r["target"]): r for _, r in fits.iterrows()}
    judged = {t: well_determined(by_target[float(t)], results.front) for t in order}
    # The hardest settled target; else the hardest whose answer a next grid can settle.
    for kinds in (("",), ("thin", "extrapolated", "bound")):
        for t in reversed(order):
            if judged[t][0] in kinds:
                return by_target[float(t)], judged[t]
    if not order:
        return None, ("refused", "no target was analysed")
    return by_target[float(order[-1])], judged[order[-1]]


def recommend(results: Results, prefer: str = "balanced", target: float | None = None,
              setting: Setting | None = None) -> Recommendation:
    """The recommendation of module doc for `prefer` (PREFERENCES) at `target` (default: the
    hardest well-determined one). A loss `target` that was not analysed: a bound through
    B_crit(L) where that law stands, else KeyError naming the analysed targets."""
    if prefer not in PREFERENCES:
        raise ValueError(f"prefer: {prefer!r} is not one of {', '.join(PREFERENCES)}")
    setting = setting or Setting.from_meta(results.meta)

    def start(status: str, target: float | None, reason: str = "") -> Recommendation:
        return Recommendation(status, target, prefer, reason, unit=setting.unit,
                              per_sample=setting.per_sample,
                              data_parallel=setting.data_parallel,
                              multiple=PREFERENCES[prefer])

    if not len(results.fits):
        return start(REFUSED_STATUS, None, "nothing was fitted")
    if target is not None and not len(_target_rows(results.fits, target)):
        law = _through_law(results, target, setting, start(BOUND_STATUS, target))
        if law is not None:
            return law
    row, (kind, why) = choose_target(results, target)
    if row is None:
        return start(REFUSED_STATUS, None, why)
    t = float(row["target"])
    if kind == "":
        rec = _from_fit(results, row, setting, start(FIT_STATUS, t))
    elif kind == "thin":  # the fit's setting, said as not settled
        rec = _from_fit(results, row, setting, start(FIT_STATUS, t))
        rec.status, rec.bcrit_status = BOUND_STATUS, "thin"
        rec.reason = why + (f"; {rec.reason}" if rec.reason else "")
    elif kind in ("bound", "extrapolated"):
        rec = _from_bound(results, row, setting, start(BOUND_STATUS, t, why))
    else:
        return start(REFUSED_STATUS, t, why)
    side = side_of(row, results.front, kind) if kind else None
    if (kind in ("bound", "extrapolated") and side == "below" and rec.status != REFUSED_STATUS
            and setting.samples(rec.batch_size) <= setting.data_parallel):
        _below_smallest(row, setting, rec)
        side = None  # nothing smaller to measure: only a best rate on the grid's edge to place
    if rec.status == BOUND_STATUS:
        rec.next_grid = next_grid(results, t, setting, side)
    rec.launch = launch_line(rec)
    return rec


def _through_law(results: Results, target: float, setting: Setting, rec: Recommendation
                 ) -> Recommendation | None:
    """A loss target the sweep did not analyse, through B_crit(L) = B* / L^(1/alpha_B)
    (`analysis.loss_scaling`, Kaplan et al. 2020): a bound, saying how far the law is carried
    beyond the losses it was fitted on; no learning rate, steps or examples (nothing was
    measured there). None where the law does not stand (then the target is refused)."""
    law = results.bcrit_law
    if Direction.from_meta(results.meta).rises or not law or law.get("refused"):
        return None
    b_star, alpha = float(law.get("b_star", math.nan)), float(law.get("alpha_b", math.nan))
    fitted = results.fits[results.fits["bcrit_status"].astype(str) == FIT]["target"]
    if not (math.isfinite(b_star) and math.isfinite(alpha) and alpha > 0 and len(fitted)
            and target > 0):
        return None
    low, high = float(fitted.min()), float(fitted.max())
    b_crit = b_star / target ** (1 / alpha)
    rec.b_crit = b_crit
    rec.bcrit_status = "law"
    rec.batch_size_samples = setting.samples(rec.multiple * b_crit)
    rec.batch_size = rec.batch_size_samples * setting.per_sample
    rec.lr_status, rec.lr_reason = "refused", "no run measured a learning rate at this loss"
    kind = "an extrapolation"
    if low <= target <= high:
        where, kind = f"between the losses it was fitted on ({low:g}..{high:g})", "read"
    else:
        edge = low if target < low else high
        where = (f"{max(edge / target, target / edge):.3g}x beyond the "
                 f"{'hardest' if target < low else 'easiest'} loss it was fitted on ({edge:g})")
    rec.reason = (f"target {target:g} was not analysed; B_crit(L) = B*/L^(1/alpha_B) (B* "
                  f"{b_star:.4g}, alpha_B {alpha:.3g}) gives {b_crit:.4g} there, {where}: "
                  f"{kind} off the law through the fits, not a measurement; train to it and "
                  "analyze it")
    return rec


def _from_fit(results: Results, row: Any, setting: Setting, rec: Recommendation
              ) -> Recommendation:
    b_crit, s_min, e_min = (float(row[k]) for k in ("b_crit", "s_min", "e_min"))
    lo, hi = bcrit_interval(row)
    rec.b_crit, rec.b_crit_low, rec.b_crit_high, rec.s_min, rec.e_min = b_crit, lo, hi, s_min, \
        e_min
    rec.bcrit_status = FIT_STATUS
    rec.batch_size_preferred = rec.multiple * b_crit
    rec.smallest = setting.smallest
    rec.clipped = rec.batch_size_preferred < setting.smallest
    rec.batch_size_samples = setting.samples(rec.batch_size_preferred)
    rec.batch_size = rec.batch_size_samples * setting.per_sample
    if math.isfinite(lo) and math.isfinite(hi):
        # Rounded as the batch size is (monotone), so the interval holds it.
        rec.batch_size_low = min(setting.samples(rec.multiple * lo) * setting.per_sample,
                                 rec.batch_size)
        rec.batch_size_high = max(setting.samples(rec.multiple * hi) * setting.per_sample,
                                  rec.batch_size)
    rec.steps = s_min * (1 + b_crit / rec.batch_size)  # eq. 2.11 at the rounded batch size
    rec.examples = e_min * (1 + rec.batch_size / b_crit)
    rec.steps_over_min, rec.examples_over_min = rec.steps / s_min, rec.examples / e_min
    rec.tradeoff = tradeoff(b_crit, s_min, e_min, setting)
    _learning_rate(results, row, rec)
    if rec.lr_status not in ("fit", "interpolated", NOT_MEASURED):
        rec.status = BOUND_STATUS
        rec.reason = f"the learning rate at batch size {rec.batch_size:g}: {rec.lr_reason}"
    return rec


def _from_bound(results: Results, row: Any, setting: Setting, rec: Recommendation
                ) -> Recommendation:
    """B_crit only bounded: the grid's batch size at the bound's edge (the largest for a B_crit
    above the grid: every larger one still scales; the smallest below it), at its measured best
    learning rate, with its measured steps and examples."""
    t = float(row["target"])
    points = _target_rows(results.front, t)
    rec.bcrit_status = BOUND_STATUS
    if not len(points):
        rec.status, rec.reason = REFUSED_STATUS, rec.reason + "; no batch size reached it"
        return rec
    status = str(row.get("bcrit_status", ""))
    b_crit = float(row.get("b_crit", math.nan))
    above = status == LOWER_BOUND or (status == FIT and b_crit > points["batch_size"].max())
    edge = points.loc[points["batch_size"].idxmax() if above else points["batch_size"].idxmin()]
    rec.batch_size_side = "at_least" if above else "at_most"
    rec.batch_size = float(edge["batch_size"])
    rec.batch_size_samples = setting.samples(rec.batch_size)
    rec.steps, rec.examples = float(edge["steps"]), float(edge["examples"])
    lr = float(edge.get("lr_opt", edge["learning_rate"]))
    rec.learning_rate = lr
    if bool(edge.get("lr_on_edge", False)):
        side = str(edge.get("lr_edge", ""))
        rec.lr_status = LOWER_BOUND if side == "high" else UPPER_BOUND
        rec.lr_reason = (f"the best learning rate at {rec.batch_size:g} is on the {side} edge of "
                         "the grid")
        if side == "high":
            rec.learning_rate_low = lr
        else:
            rec.learning_rate_high = lr
        rec.learning_rate = math.nan
    else:
        rec.lr_status, rec.learning_rate_low, rec.learning_rate_high = "measured", lr, lr
        rec.lr_reason = f"the grid's best learning rate at {rec.batch_size:g}"
    return rec


def _below_smallest(row: Any, setting: Setting, rec: Recommendation) -> None:
    """B_crit below the grid's smallest batch, which is the smallest a run can take (module
    doc): an answer, said in words, at the measured best learning rate there."""
    rec.smallest = setting.smallest
    rec.bcrit_status = "below_smallest"
    bound = float(row.get("b_crit_bound", math.nan))
    if not math.isfinite(bound) or str(row.get("bcrit_status", "")) == FIT:
        bound = min(float(row.get("b_crit", math.nan)), rec.batch_size)
    rec.b_crit_high = bound if math.isfinite(bound) and bound > 0 else rec.batch_size
    at = setting.said(rec.batch_size)
    rec.reason = (f"B_crit lies below the smallest batch a run can take ({at}): from that size "
                  "up every batch takes about the same steps (S = S_min (1 + B_crit/B), "
                  "B_crit/B < 1), so a larger batch buys almost no steps and costs examples; "
                  "choose the batch size for throughput (the smallest that keeps the device "
                  "busy)")
    if rec.lr_status == "measured":
        rec.status = FIT_STATUS
        rec.reason += f"; the measured best learning rate at {at} is {rec.learning_rate:.3g}"
    else:
        rec.status = BOUND_STATUS
        rec.reason += f"; {rec.lr_reason}"


BELOW_ADVICE = "the sweep only bounds it, add batch sizes below"
"""How the analysis's warning ends for a B_crit below its smallest batch size."""


def floor_warnings(results: Results, setting: Setting) -> list[str]:
    """The analysis's warnings, where a B_crit below the smallest batch size is at the smallest
    batch a run can take (nothing smaller can run): said so instead of "add batch sizes below"."""
    out = []
    for warning in results.warnings:
        if BELOW_ADVICE in warning and warning.startswith("target "):
            target = float(warning.split(":")[0].removeprefix("target "))
            rows = _target_rows(results.front, target)
            if len(rows) and float(rows["batch_size"].min()) <= setting.smallest * (1 + 1e-9):
                warning = warning.replace(BELOW_ADVICE, (
                    "no smaller batch can run (one sample per process): every batch from there "
                    "up takes about the same steps; choose the batch size for throughput"))
        out.append(warning)
    return out


def _learning_rate(results: Results, row: Any, rec: Recommendation) -> None:
    """The learning rate at rec.batch_size (module doc): fills learning_rate[_low/_high],
    lr_status and lr_reason."""
    b = rec.batch_size
    t = float(row["target"])
    points = _target_rows(results.front, t)
    if len(points):  # a grid point with a learning rate (a table may give none)
        rates = points["lr_opt"].astype(float)
        points = points[np.isfinite(rates) & (rates > 0)]
    if not len(points):
        rec.lr_status = NOT_MEASURED
        rec.lr_reason = ("no learning rate was given with the measurements (a table of already "
                         "tuned points): keep the one tuned at that batch size")
        return
    inside = points[~points["lr_on_edge"].astype(bool)]
    model = str(row.get("lr_model", "") or "")
    status = str(row.get("lr_status", "") or "")
    if len(inside):
        low, high = float(inside["batch_size"].min()), float(inside["batch_size"].max())
    else:
        low = high = math.nan
    if status == FIT and model and low <= b <= high:
        eps_max, b_noise = float(row["eps_max"]), float(row["b_noise_lr"])
        alpha = float(row.get("lr_alpha", 1.0)) if model == "power" else 1.0
        if all(math.isfinite(x) and x > 0 for x in (eps_max, b_noise, alpha)):
            rec.learning_rate = float(lr_law.eps_opt(b, eps_max, b_noise, alpha))
            rec.learning_rate_low, rec.learning_rate_high = lr_interval(
                inside["batch_size"].to_numpy(float), inside["lr_opt"].to_numpy(float), b,
                (eps_max, b_noise, alpha), model, int(results.meta.get("bootstrap") or 0))
            rec.lr_status = "fit"
            rec.lr_reason = (f"eq. 2.7 fit ({model}) of the best learning rates at "
                             f"{low:g}..{high:g}")
            return
    # The two measured best rates around b, both inside the grid: log-log interpolation.
    below = inside[inside["batch_size"] <= b]
    above = inside[inside["batch_size"] >= b]
    if len(below) and len(above):
        p = below.loc[below["batch_size"].idxmax()]
        q = above.loc[above["batch_size"].idxmin()]
        bp, bq = float(p["batch_size"]), float(q["batch_size"])
        lp, lq = float(p["lr_opt"]), float(q["lr_opt"])
        w = 0.0 if bq == bp else math.log(b / bp) / math.log(bq / bp)
        rec.learning_rate = math.exp((1 - w) * math.log(lp) + w * math.log(lq))
        rec.learning_rate_low, rec.learning_rate_high = min(lp, lq), max(lp, lq)
        rec.lr_status = "interpolated"
        why = str(row.get("lr_refused", "") or "") or "no eq. 2.7 fit"
        rec.lr_reason = (f"between the measured best rates at {bp:g} and {bq:g} ({why})")
        return
    # Outside every best rate measured off the grid's edges: only a side is known.
    edge_rows = points[points["lr_on_edge"].astype(bool)] if len(points) else points
    nearest = (points.iloc[(np.log(points["batch_size"].astype(float) / b)).abs().argsort()]
               if len(points) else points)
    if not len(nearest):
        rec.lr_status, rec.lr_reason = "refused", "no batch size reached the target"
        return
    near = nearest.iloc[0]
    lr = float(near["lr_opt"])
    if bool(near["lr_on_edge"]):
        side = str(near["lr_edge"])
        rec.lr_status = LOWER_BOUND if side == "high" else UPPER_BOUND
        if side == "high":
            rec.learning_rate_low = lr
        else:
            rec.learning_rate_high = lr
        rec.lr_reason = (f"the best learning rate at batch size {float(near['batch_size']):g} "
                         f"is on the {side} edge of the grid ({lr:g}); "
                         f"{len(edge_rows)} of {len(points)} batch sizes have it there")
        return
    # Beyond the measured batch sizes: eq. 2.7 rises with B, so the nearest measured best is a
    # lower bound above them and an upper bound below them.
    if b > float(near["batch_size"]):
        rec.lr_status, rec.learning_rate_low = LOWER_BOUND, lr
        where = "above the largest"
    else:
        rec.lr_status, rec.learning_rate_high = UPPER_BOUND, lr
        where = "below the smallest"
    rec.lr_reason = (f"batch size {b:g} lies {where} batch size with a best learning rate inside "
                     f"the grid ({float(near['batch_size']):g}, best {lr:g}): eq. 2.7 would "
                     "extrapolate")


def lr_interval(batch_sizes: np.ndarray, lrs: np.ndarray, b: float,
                params: tuple[float, float, float], model: str, bootstrap: int = 0
                ) -> tuple[float, float]:
    """95% interval of eps_opt(b) from the eq. 2.7 fit to (batch_sizes, lrs): the delta method
    on log eps_opt with the fit's covariance sigma^2 (J^T J)^-1 (sigma^2 = RSS / dof), or, with
    `bootstrap` > 0, percentiles of a residual bootstrap of that many refits (at most
    MAX_LR_BOOTSTRAP; used only where it holds eps_opt(b) itself). NaN where the fit has no
    degrees of freedom left."""
    eps_max, b_noise, alpha = params
    n_params = 3 if model == "power" else 2
    ok = np.isfinite(batch_sizes) & np.isfinite(lrs) & (batch_sizes > 0) & (lrs > 0)
    x, y = np.log(batch_sizes[ok]), np.log(lrs[ok])
    theta = np.array([math.log(eps_max), math.log(b_noise), alpha][:n_params])
    dof = len(x) - n_params
    if dof <= 0:
        return math.nan, math.nan

    def log_eps(th: np.ndarray, log_b: np.ndarray) -> np.ndarray:
        a = th[2] if n_params == 3 else 1.0
        return th[0] - np.logaddexp(0.0, a * (th[1] - log_b))

    res = y - log_eps(theta, x)
    if bootstrap > 0:
        rng = np.random.default_rng(0)
        scaled = (res - res.mean()) * math.sqrt(len(x) / dof)
        draws = []
        for _ in range(min(bootstrap, MAX_LR_BOOTSTRAP)):
            noisy = np.exp(log_eps(theta, x) + rng.choice(scaled, len(x), replace=True))
            try:
                fit = fit_lr(np.exp(x), noisy, model)
            except FitRefused:
                continue
            draws.append(float(lr_law.eps_opt(b, fit.eps_max, fit.b_noise, fit.alpha)))
        centre_lr = float(lr_law.eps_opt(b, eps_max, b_noise, alpha))
        if len(draws) >= 20:
            lo, hi = np.percentile(draws, (2.5, 97.5))
            if lo <= centre_lr <= hi:  # else the delta method's, which holds its value
                return float(lo), float(hi)
    step = 1e-6
    jac = np.empty((len(x), n_params))
    grad = np.empty(n_params)
    for k in range(n_params):
        d = np.zeros(n_params)
        d[k] = step
        jac[:, k] = (log_eps(theta + d, x) - log_eps(theta - d, x)) / (2 * step)
        grad[k] = float((log_eps(theta + d, np.array([math.log(b)]))
                         - log_eps(theta - d, np.array([math.log(b)])))[0] / (2 * step))
    sigma2 = float(res @ res) / dof
    try:
        cov = np.linalg.inv(jac.T @ jac) * sigma2
    except np.linalg.LinAlgError:
        return math.nan, math.nan
    var = float(grad @ cov @ grad)
    if not (math.isfinite(var) and var >= 0):
        return math.nan, math.nan
    centre = float(log_eps(theta, np.array([math.log(b)]))[0])
    spread = Z95 * math.sqrt(var)
    return math.exp(centre - spread), math.exp(centre + spread)


def launch_line(rec: Recommendation) -> str:
    """Overrides for the next `gnsweep launch`: the recommended batch size (samples a step) and
    learning rate for a fit; the next grid's batch sizes and learning rates for a bound."""
    if rec.status == FIT_STATUS:
        line = f"sweep.batch_sizes=[{rec.batch_size_samples}]"
        if math.isfinite(rec.learning_rate):
            line += f" sweep.learning_rates=[{rec.learning_rate:.3g}]"
        return line
    if rec.next_grid is not None and rec.next_grid.runs:
        return rec.next_grid.overrides()
    return ""
