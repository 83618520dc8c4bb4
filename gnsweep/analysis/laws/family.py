"""Laws across scale from a family of cells: the optimum of every (N, D) cell, power laws of
B_opt, lr_opt and the critical batch size against N and D, the fit checked on the largest
scale left out, and a prediction at a new (N, D).

Two kinds of input (docs/laws.md):
- fixed budget: one row per run with `N, D, batch_size, learning_rate, loss` (the final loss
  after D examples or tokens); each cell's optimum comes from `cells.cell_optimum`;
- steps to target: one row per run with `N` (and `D` where known), `batch_size`, `steps`,
  optional `target` and `learning_rate`; each cell's B_crit comes from the fit of eq. 2.11
  (`analysis.fit.fit_hyperbola`) on the fewest steps per batch size.

Each law keeps a variable's exponent only where the data determine it (`power.select_form`).
Steps-to-target tables whose models each reached their own target give B_crit laws across
models at their targets, against N and against the target loss (Kaplan's B_crit(L)).

Held out by default: each law is fitted again without the largest usable cell (largest N*D),
which it then predicts; `held_out` holds predicted against measured. Pure: no files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from gnsweep.analysis.fit import FitRefused, fit_hyperbola
from gnsweep.analysis.laws.cells import (
    CellOptimum,
    CellRefused,
    cell_optimum,
    configurations,
    relative_excess,
)
from gnsweep.analysis.laws.power import LawRefused, PowerLaw, select_form
from gnsweep.errors import ConfigError
from gnsweep.tables import columns

FIXED_BUDGET = "fixed_budget"
STEPS = "steps_to_target"
DEFAULT_TOLERANCE = 0.0025
"""Relative loss tolerance of the near-optimal set and of the fixed-budget critical batch size:
Step Law's (Li et al. 2025) 0.25% of the best loss. A grid whose seed-to-seed noise is larger
needs more (`--tolerance`); the cells report that noise (`seed_sd`) where seeds repeat."""
DEFAULT_BOOTSTRAP = 200
QUANTITIES = ("batch_size", "learning_rate", "b_crit")
"""B_opt, lr_opt and the critical batch size: the `quantity` of a law."""
REFERENCES: list[dict[str, Any]] = [
    {"source": "DeepSeek LLM (Bi et al. 2024), eq. 1", "quantity": "batch_size",
     "form": "0.2920 * C^0.3271", "unit": "tokens; C = M D in FLOPs (M: non-embedding FLOPs "
     "a token)"},
    {"source": "DeepSeek LLM (Bi et al. 2024), eq. 1", "quantity": "learning_rate",
     "form": "0.3118 * C^-0.1250", "unit": "AdamW peak learning rate; C in FLOPs"},
    {"source": "Li et al. 2025 (Step Law)", "quantity": "learning_rate",
     "form": "1.79 * N^-0.713 * D^0.307", "unit": "AdamW peak learning rate; N parameters "
     "without the vocabulary's, D tokens"},
    {"source": "Li et al. 2025 (Step Law)", "quantity": "batch_size",
     "form": "0.58 * D^0.571", "unit": "tokens; D tokens"},
]
"""Published laws, printed beside the fitted ones as references only: other models, other
optimizers (AdamW), other units; never used by the fit."""


@dataclass(frozen=True)
class Law:
    """One fitted law with its held-out check."""

    quantity: str
    law: PowerLaw
    target: float | None
    held_out: dict[str, Any]
    """{N, D, predicted, predicted_low, predicted_high, measured, ratio, form} or with
    `refused`."""
    form_reason: list[str] = field(default_factory=list)
    """Why each variable's exponent was kept or left out (`power.select_form`)."""
    scope: str = ""
    """Which cells: "" for those at `target` (or every cell), OWN_TARGETS for cells each at
    its own target loss."""


@dataclass
class Laws:
    """Everything `gnsweep laws` prints and writes."""

    kind: str
    tolerance: float
    bootstrap: int
    cells: pd.DataFrame
    """One row per (N, D) cell (and target for steps tables): columns("law_cells")."""
    laws: list[Law]
    refused: list[dict[str, Any]]
    """{quantity, target, reason} for each law that could not be fitted."""
    warnings: list[str] = field(default_factory=list)
    held_out_loss: dict[str, Any] | None = None
    """Fixed budget: the loss the held-out cell's grid has at the predicted (B, lr)."""
    prediction: dict[str, Any] | None = None

    @property
    def tolerance_source(self) -> str:
        """Whose tolerance this is: the published method's default, or the one given."""
        if self.kind != FIXED_BUDGET:
            return ""
        return ("the published method's default: Step Law's 0.25% of the best loss (Li et al. "
                "2025)" if self.tolerance == DEFAULT_TOLERANCE else "given (--tolerance)")

    def law(self, quantity: str, target: float | None = None) -> Law | None:
        for law in self.laws:
            if law.quantity == quantity and (target is None or law.target == target):
                return law
        return None


def parse_point(text: str) -> tuple[float, float, float | None]:
    """`N=7e9,D=1.4e12[,M=4.2e10]` -> (N, D, M or None); ConfigError in one line otherwise.
    M is the non-embedding FLOPs a token (DeepSeek LLM's M), for DeepSeek's law at C = M D."""
    values: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or key not in ("N", "D", "M"):
            raise ConfigError(f"--predict {text}: give N=<parameters>,D=<examples or tokens> "
                              "(and optionally M=<non-embedding FLOPs a token>), e.g. "
                              "--predict N=7e9,D=1.4e12")
        if key in values:
            raise ConfigError(f"--predict {text}: {key} given twice; give each key once, e.g. "
                              "--predict N=7e9,D=1.4e12")
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"--predict: {key}={raw.strip()} is not a number") from None
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--predict: {key}={raw.strip()} must be a positive number")
        values[key] = value
    missing = [k for k in ("N", "D") if k not in values]
    if missing:
        raise ConfigError(f"--predict {text}: {' and '.join(missing)} missing; give both, e.g. "
                          "--predict N=7e9,D=1.4e12")
    return values["N"], values["D"], values.get("M")


def _variables(n: np.ndarray, d: np.ndarray) -> tuple[str, ...]:
    """The variables that take more than one value (an unknown D never varies)."""
    return tuple(name for name, v in (("N", n), ("D", d))
                 if len(np.unique(v[np.isfinite(v)])) > 1)


def _scale_order(n: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Indices from the largest scale down: N*D, then D, then N (an unknown D counts as 1)."""
    d = np.nan_to_num(d, nan=1.0)
    return np.lexsort((-n, -d, -(n * d)))


def fit_family(cells: pd.DataFrame, draws: dict[str, np.ndarray], *, bootstrap: int,
               seed: int = 0, quantities: tuple[str, ...] = QUANTITIES
               ) -> tuple[list[Law], list[dict[str, Any]]]:
    """Fit each quantity's law over the usable cells, with its held-out check.

    `draws[quantity]`: bootstrap draws of log y per cell, shape (n_draws, len(cells)), or
    absent (the law's residuals alone make the interval)."""
    laws, refused = [], []
    targets = (cells["target"].unique().tolist() if "target" in cells
               and cells["target"].notna().any() else [None])
    for quantity in quantities:
        for target in targets:
            rows = cells[f"{quantity}_usable"].to_numpy(bool).copy()
            if target is not None:
                rows &= (cells["target"] == target).to_numpy()
            where = np.flatnonzero(rows)
            n = cells["N"].to_numpy(float)[where]
            d = cells["D"].to_numpy(float)[where]
            y = cells[quantity].to_numpy(float)[where]
            point_draws = draws.get(quantity)
            point_draws = None if point_draws is None else point_draws[:, where]
            variables = _variables(n, d)
            if len(where) < 3:  # a point to fit through and one to judge it by, at least
                refused.append({"quantity": quantity, "target": target,
                                "reason": f"{_usable_line(cells, quantity, target)}; a law "
                                          "needs at least 3"})
                continue
            try:
                if not variables:
                    raise LawRefused("neither N nor D varies across the cells")
                law, why = select_form(quantity, variables, n, d, y, point_draws,
                                       bootstrap=bootstrap, seed=seed)
                _scales(law, why)
            except LawRefused as err:
                refused.append({"quantity": quantity, "target": target,
                                "reason": f"{_usable_line(cells, quantity, target)}: {err}"})
                continue
            laws.append(Law(quantity, law, target, _held_out(
                quantity, variables, n, d, y, point_draws, bootstrap, seed,
                chosen=law.variables), why))
    return laws, refused


def _scales(law: PowerLaw, why: list[str]) -> None:
    """A law across scale must keep a variable: where the cells determine no exponent (a flat
    valley's optima are noise, plain SGD's at a fixed budget), a constant fitted through them
    would be a headline the data do not support. LawRefused with the reasons otherwise."""
    if not law.variables:
        raise LawRefused("the cells determine no exponent (" + "; ".join(why) + ")")


def _usable_line(cells: pd.DataFrame, quantity: str, target: float | None) -> str:
    rows = cells if target is None else cells[cells["target"] == target]
    used = int(rows[f"{quantity}_usable"].sum())
    return f"{used} of {len(rows)} cell(s) usable"


def _held_out(quantity: str, variables: tuple[str, ...], n: np.ndarray, d: np.ndarray,
              y: np.ndarray, point_draws: np.ndarray | None, bootstrap: int, seed: int,
              top: int | None = None, chosen: tuple[str, ...] | None = None
              ) -> dict[str, Any]:
    """Fit without the largest cell (its form chosen again without it), predict it:
    {N, D, predicted, ..., measured, form}."""
    top = int(_scale_order(n, d)[0]) if top is None else top
    keep = np.arange(len(y)) != top
    out: dict[str, Any] = {"N": float(n[top]), "D": float(d[top]), "predicted": None,
                           "predicted_low": None, "predicted_high": None,
                           "measured": float(y[top]), "ratio": None}
    # The form is chosen again from every variable; where the cells left cannot carry that
    # many coefficients, from the form chosen on all of them.
    candidates = [variables] + ([chosen] if chosen is not None and chosen != variables else [])
    why = ""
    for form in candidates:
        # A law's second variable is D, or the target loss L for a law in L (power._row).
        single = [v for v in form if len(np.unique((n if v == "N" else d)[keep])) < 2]
        if single:
            why = "without the largest cell " + " and ".join(single) + " takes one value only"
            continue
        try:
            law, _ = select_form(quantity, form, n[keep], d[keep], y[keep],
                                 None if point_draws is None else point_draws[:, keep],
                                 bootstrap=bootstrap, seed=seed)
            break
        except LawRefused as err:
            why = f"without the largest cell: {err}"
    else:
        out["refused"] = why
        return out
    value, low, high = law.predict(n[top], d[top])
    out.update(predicted=value, predicted_low=low, predicted_high=high,
               ratio=value / float(y[top]), form=law.form)
    return out


# -- fixed budget ----------------------------------------------------------------------------


def fixed_budget_laws(runs: pd.DataFrame, *, tolerance: float = DEFAULT_TOLERANCE,
                      bootstrap: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> Laws:
    """Laws from fixed-budget runs: columns N, D, batch_size, learning_rate, loss (one row a
    run; a non-finite loss is a diverged run)."""
    rows, optima, warnings = [], [], []
    for (n, d), group in runs.groupby(["N", "D"], sort=True):
        try:
            opt = cell_optimum(group["batch_size"].to_numpy(float),
                               group["learning_rate"].to_numpy(float),
                               group["loss"].to_numpy(float), tolerance=tolerance,
                               bootstrap=bootstrap, seed=seed)
        except CellRefused as err:
            warnings.append(f"cell N={n:g} D={d:g}: {err}; left out")
            continue
        if opt.edge:
            warnings.append(f"cell N={n:g} D={d:g}: left out of the B_opt and lr_opt laws: "
                            f"{opt.edge_reason}")
        rows.append(_cell_row(float(n), float(d), opt))
        optima.append(opt)
    if not rows:
        raise CellRefused(f"no cell can be used ({warnings[0]})" if warnings
                          else "no cell has a finite loss")
    cells = pd.DataFrame(rows)
    cells = cells.assign(batch_size_usable=~cells["edge"], learning_rate_usable=~cells["edge"],
                         b_crit_usable=cells["b_crit_status"] == "fit")
    n_draws = max(bootstrap, 1)
    draws = {"batch_size": np.stack([o.draws[np.arange(n_draws) % len(o.draws), 0]
                                     for o in optima], axis=1),
             "learning_rate": np.stack([o.draws[np.arange(n_draws) % len(o.draws), 1]
                                        for o in optima], axis=1)}
    laws, refused = fit_family(cells, draws, bootstrap=bootstrap, seed=seed)
    # The standard error of a configuration's mean loss over its seeds: two configurations a
    # tolerance apart cannot be told apart where it is above half the tolerance.
    error = cells["seed_sd"] / np.sqrt(cells["seeds"])
    noisy = cells[error.notna() & (2 * error > tolerance * cells["best_loss"].abs())]
    if len(noisy):
        warnings.append(f"{len(noisy)} cell(s) have a standard error of a configuration's mean "
                        f"loss over its seeds above half the tolerance ({tolerance:g} of the "
                        "best loss): give a larger --tolerance, or more seeds")
    result = Laws(FIXED_BUDGET, tolerance, bootstrap, cells.reindex(columns=columns("law_cells")),
                  laws, refused, warnings)
    result.held_out_loss = _held_out_loss(result, runs)
    return result


def _cell_row(n: float, d: float, opt: CellOptimum) -> dict[str, Any]:
    return {"N": n, "D": d, "target": math.nan, "batch_size": opt.batch_size,
            "learning_rate": opt.learning_rate, "loss": opt.loss, "edge": opt.edge,
            "edge_reason": opt.edge_reason, "method": opt.method, "best_loss": opt.best_loss,
            "batch_size_low": opt.batch_size_low, "batch_size_high": opt.batch_size_high,
            "learning_rate_low": opt.learning_rate_low,
            "learning_rate_high": opt.learning_rate_high, "n_runs": opt.n_runs,
            "n_configs": opt.n_configs, "n_diverged": opt.n_diverged, "n_near": opt.n_near,
            "near_batch_low": opt.near_batch_low, "near_batch_high": opt.near_batch_high,
            "near_lr_low": opt.near_lr_low, "near_lr_high": opt.near_lr_high,
            "b_crit": opt.b_crit, "b_crit_status": opt.b_crit_status, "widened": opt.widened,
            "seeds": opt.seeds, "seed_sd": opt.seed_sd}


def _held_out_loss(result: Laws, runs: pd.DataFrame) -> dict[str, Any] | None:
    """The held-out cell's measured loss nearest the predicted (B_opt, lr_opt), against its best:
    what following the laws would have cost at the largest scale."""
    b_law, lr_law = result.law("batch_size"), result.law("learning_rate")
    if b_law is None or lr_law is None:
        return None
    hb, hl = b_law.held_out, lr_law.held_out
    if hb["predicted"] is None or hl["predicted"] is None or (hb["N"], hb["D"]) != (hl["N"],
                                                                                   hl["D"]):
        return None
    group = runs[(runs["N"] == hb["N"]) & (runs["D"] == hb["D"])]
    b, lr, loss, _ = configurations(group["batch_size"].to_numpy(float),
                                    group["learning_rate"].to_numpy(float),
                                    group["loss"].to_numpy(float))
    finite = np.isfinite(loss)
    x, y = np.log(b), np.log(lr)
    sx = float(np.median(np.diff(np.unique(x)))) if len(np.unique(x)) > 1 else 1.0
    sy = float(np.median(np.diff(np.unique(y)))) if len(np.unique(y)) > 1 else 1.0
    distance = np.hypot((x - math.log(hb["predicted"])) / sx, (y - math.log(hl["predicted"])) / sy)
    nearest = int(np.argmin(distance))
    best = float(loss[finite].min())
    return {"N": hb["N"], "D": hb["D"], "batch_size": float(b[nearest]),
            "learning_rate": float(lr[nearest]), "grid_steps_away": float(distance[nearest]),
            "loss": float(loss[nearest]), "best_loss": best,
            "excess": float(relative_excess(loss[nearest], best))}


# -- steps to target ------------------------------------------------------------------------


def steps_laws(runs: pd.DataFrame, *, bootstrap: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> Laws:
    """Laws of B_crit from steps-to-target runs: columns N, D (NaN where unknown), batch_size,
    steps, target, learning_rate (NaN where absent). One fit of eq. 2.11 per (N, D, target)."""
    rows, warnings = [], []
    for (n, d, target), group in runs.groupby(["N", "D", "target"], sort=True, dropna=False):
        best = group.sort_values("steps").groupby("batch_size", sort=True).first().reset_index()
        row = {"N": float(n), "D": float(d), "target": float(target), "loss": float(target),
               "batch_size": math.nan, "learning_rate": math.nan, "edge": True,
               "edge_reason": "", "method": "eq. 2.11", "b_crit": math.nan,
               "b_crit_status": "refused", "n_runs": len(group), "n_configs": len(best)}
        try:
            fit = fit_hyperbola(best["batch_size"].to_numpy(float), best["steps"].to_numpy(float))
        except FitRefused as err:
            row["edge_reason"] = str(err)
        else:
            row.update(b_crit=fit.b_crit, b_crit_status=fit.status, edge=fit.status != "fit",
                       edge_reason=fit.reason, batch_size=fit.b_crit,
                       b_crit_log_se=fit.b_crit_se / fit.b_crit)
            if best["learning_rate"].notna().any():
                nearest = int(np.argmin(np.abs(np.log(best["batch_size"].to_numpy(float)
                                                      / fit.b_crit))))
                row["learning_rate"] = float(best["learning_rate"].iloc[nearest])
        if row["edge"]:
            warnings.append(f"cell N={n:g}{'' if math.isnan(d) else f' D={d:g}'} target "
                            f"{target:g}: B_crit {str(row['b_crit_status']).replace('_', ' ')}"
                            f" ({row['edge_reason']}); left out")
        rows.append(row)
    cells = pd.DataFrame(rows)
    # D unknown everywhere: a law in N alone; known for some cells only: those cells.
    known_d = cells["D"].notna() | cells["D"].isna().all()
    cells = cells.assign(b_crit_usable=~cells["edge"] & known_d, batch_size_usable=False,
                         learning_rate_usable=False)
    # Each cell's B_crit drawn from its delta-method error (analysis.fit), in log space.
    spread = np.nan_to_num(cells.get("b_crit_log_se", pd.Series(0.0, index=cells.index))
                           .to_numpy(float), nan=0.0)
    noise = np.random.default_rng(seed).standard_normal((max(bootstrap, 1), len(cells)))
    draws = {"b_crit": np.log(cells["b_crit"].to_numpy(float)) + noise * spread}
    if _own_targets(cells):
        laws, refused = _own_target_laws(cells, draws["b_crit"], bootstrap=bootstrap, seed=seed)
    else:
        laws, refused = fit_family(cells, draws, bootstrap=bootstrap, seed=seed,
                                   quantities=("b_crit",))
    return Laws(STEPS, math.nan, bootstrap, cells.reindex(columns=columns("law_cells")), laws,
                refused, warnings)


def predict(result: Laws, n: float, d: float, runs_n: np.ndarray, runs_d: np.ndarray,
            flops_per_token: float | None = None) -> dict[str, Any]:
    """The laws at (N, D) with their 95% intervals and how far beyond the family it reaches;
    the published references at the same point (DeepSeek's where the FLOPs a token are
    given)."""
    out: dict[str, Any] = {"N": n, "D": d}
    for quantity in ("batch_size", "learning_rate"):
        law = result.law(quantity)
        value = low = high = None
        if law is not None:
            value, low, high = law.law.predict(n, d)
        out.update({quantity: value, f"{quantity}_low": low, f"{quantity}_high": high})
    crit = result.law("b_crit")
    if crit is not None:
        out["b_crit"], out["b_crit_low"], out["b_crit_high"] = crit.law.predict(n, d)
    top_n, top_d = float(np.nanmax(runs_n)), float(np.nanmax(runs_d))
    out["extrapolation_N"] = n / top_n
    out["extrapolation_D"] = d / top_d
    out["extrapolation"] = max(out["extrapolation_N"], out["extrapolation_D"])
    notes = [f"{r['quantity']}: no law ({r['reason']}), so no prediction"
             for r in result.refused if r["quantity"] in ("batch_size", "learning_rate")]
    for quantity in ("batch_size", "learning_rate", "b_crit"):
        law = result.law(quantity)
        if law is not None and "N" not in law.law.variables and n != top_n:
            why = ("one model size swept" if len(np.unique(runs_n)) < 2
                   else "its exponent is not determined by the cells (form_reason)")
            notes.append(f"{quantity}: N does not enter the law ({why})")
    out["notes"] = notes
    # Step Law's laws at the same (N, D), for comparison only (AdamW language models, N
    # without the vocabulary's parameters, D and B in tokens).
    out["references"] = {"step_law_batch_size": STEP_LAW["batch_size"](n, d),
                         "step_law_learning_rate": STEP_LAW["learning_rate"](n, d)}
    if flops_per_token is not None:
        compute = flops_per_token * d
        out["references"].update(
            flops_per_token=flops_per_token, compute=compute,
            deepseek_batch_size=DEEPSEEK["batch_size"](compute),
            deepseek_learning_rate=DEEPSEEK["learning_rate"](compute))
    else:
        notes.append("DeepSeek's law needs the non-embedding FLOPs a token: give "
                     "--predict N=..,D=..,M=<FLOPs a token>")
    return out


DEEPSEEK = {"batch_size": lambda c: 0.2920 * c ** 0.3271,
            "learning_rate": lambda c: 0.3118 * c ** -0.1250}
"""DeepSeek LLM's (Bi et al. 2024, eq. 1) laws in the compute C = M D, as in REFERENCES."""


STEP_LAW = {"batch_size": lambda n, d: 0.58 * d ** 0.571,
            "learning_rate": lambda n, d: 1.79 * n ** -0.713 * d ** 0.307}
"""Li et al. 2025's fitted laws (their eq. for B(D) and eta(N, D)), as in REFERENCES."""


OWN_TARGETS = "each model at its own target"
"""The scope of a B_crit law fitted across models that each reached their own target loss."""


def _own_targets(cells: pd.DataFrame) -> bool:
    """Each model size at its own target (more than one target, one target per N among the
    usable cells): the shape Zhang et al. 2024 and Kaplan et al. 2020 publish."""
    usable = cells[cells["b_crit_usable"]]
    return (usable["target"].nunique() > 1
            and bool((usable.groupby("N")["target"].nunique() == 1).all()))


def _own_target_laws(cells: pd.DataFrame, draws: np.ndarray, *, bootstrap: int, seed: int
                     ) -> tuple[list[Law], list[dict[str, Any]]]:
    """B_crit across models at their own targets: against N (`c * N^a`), and against the target
    loss L as Kaplan et al. 2020's `B_crit(L) = B* / L^(1/alpha_B)` (`c * L^g`, g = -1/alpha_B),
    each with the largest model held out and predicted."""
    where = np.flatnonzero(cells["b_crit_usable"].to_numpy(bool))
    n = cells["N"].to_numpy(float)[where]
    loss = cells["target"].to_numpy(float)[where]
    y = cells["b_crit"].to_numpy(float)[where]
    point_draws = draws[:, where]
    top = int(np.argmax(n))
    laws, refused = [], []
    used = f"{len(where)} of {len(cells)} cell(s) usable, {OWN_TARGETS}"
    for variable, second in (("N", np.ones_like(n)), ("L", loss)):
        if variable == "L" and not (loss > 0).all():
            refused.append({"quantity": "b_crit", "target": None, "scope": OWN_TARGETS,
                            "reason": f"{used}: B_crit(L) needs positive target losses"})
            continue
        if len(where) < 3:
            refused.append({"quantity": "b_crit", "target": None, "scope": OWN_TARGETS,
                            "reason": f"{used}; a law needs at least 3"})
            break
        try:
            law, why = select_form("b_crit", (variable,), n, second, y, point_draws,
                                   bootstrap=bootstrap, seed=seed)
            _scales(law, why)
        except LawRefused as err:
            refused.append({"quantity": "b_crit", "target": None, "scope": OWN_TARGETS,
                            "reason": f"{used}: {err}"})
            continue
        held = _held_out("b_crit", (variable,), n, second, y, point_draws, bootstrap, seed,
                         top=top)
        held = {**held, "D": float(cells["D"].to_numpy(float)[where][top]),
                "target": float(loss[top])}
        laws.append(Law("b_crit", law, None, held, why, scope=OWN_TARGETS))
    return laws, refused
