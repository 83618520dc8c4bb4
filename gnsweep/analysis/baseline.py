"""Fit regression for CI: record a sweep's fits, then check later fits against the record.

A figure passes when it moved by at most `rtol` relative to the baseline, or by at most `k_se`
combined standard errors `sqrt(se_old^2 + se_new^2)`. A target that had a fit and lost it fails;
a target new since the baseline is reported, never failed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

FIGURES = ("b_crit", "s_min", "e_min")
VERSION = 1
DEFAULT_RTOL = 0.05
DEFAULT_K_SE = 0.0


class BaselineError(ValueError):
    """The baseline file is not one `gnsweep baseline` wrote; the message says what is wrong."""


def make_baseline(fits: pd.DataFrame, *, rtol: float = DEFAULT_RTOL, k_se: float = DEFAULT_K_SE,
                  source: str = "", group_by: str | None = None) -> dict[str, Any]:
    """The record `gnsweep check` compares against: per target (per group and target with
    `group_by`, the column of a multi-workload analysis), each figure and its error."""
    targets = []
    order = [group_by, "target"] if group_by else ["target"]
    for _, row in fits.sort_values(order, ascending=[True, False][-len(order):]).iterrows():
        entry: dict[str, Any] = {"target": float(row["target"]), "refused": str(row["refused"])}
        if group_by:
            entry["group"] = str(row[group_by])
        for name in FIGURES:
            entry[name] = _num(row[name])
            entry[f"{name}_se"] = _num(row[f"{name}_se"])
        targets.append(entry)
    record = {"version": VERSION, "source": source, "tolerance": {"rtol": rtol, "k_se": k_se},
              "targets": targets}
    if group_by:
        record["group_by"] = group_by
    return record


def _num(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Case:
    """One (target, figure) comparison."""

    target: float
    figure: str
    old: float
    new: float
    ok: bool
    message: str
    group: str = ""
    """The group (workload) of a multi-workload baseline; "" otherwise."""

    @property
    def label(self) -> str:
        return (f"{self.group} " if self.group else "") + f"target {self.target:g}"


def validate(baseline: Any) -> dict[str, Any]:
    if not isinstance(baseline, dict) or baseline.get("version") != VERSION:
        raise BaselineError(f"not a gnsweep baseline (version {VERSION}); write one with "
                            "`gnsweep baseline DIR -o FILE`")
    targets = baseline.get("targets")
    if not isinstance(targets, list) or not all(
            isinstance(t, dict) and _finite(t.get("target")) for t in targets):
        raise BaselineError("'targets' must be a list of objects with a numeric 'target'")
    for entry in targets:
        for name in (*FIGURES, *(f"{f}_se" for f in FIGURES)):
            value = entry.get(name)
            if value is not None and not _number(value):
                raise BaselineError(f"target {entry['target']}: {name} "
                                    f"{str(value)[:40]!r} is not a number")
    tolerance = baseline.get("tolerance", {})
    if not isinstance(tolerance, dict) or not all(
            _finite(tolerance.get(k, 0.0)) for k in ("rtol", "k_se")):
        raise BaselineError("'tolerance' must be an object whose rtol and k_se are numbers")
    if not isinstance(baseline.get("group_by") or "", str):
        raise BaselineError("'group_by' must be the name of a column")
    return baseline


def _number(value: Any) -> bool:
    """A JSON number a float holds (not a bool, not an integer beyond a float's range)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _finite(value: Any) -> bool:
    return _number(value) and math.isfinite(float(value))


def compare(baseline: dict[str, Any], fits: pd.DataFrame, rtol: float | None = None,
            k_se: float | None = None) -> list[Case]:
    """Every (target, figure) of the baseline against the new fits; tolerances default to the
    baseline's own."""
    baseline = validate(baseline)
    tolerance = baseline.get("tolerance", {})
    rtol = float(tolerance.get("rtol", DEFAULT_RTOL)) if rtol is None else rtol
    k_se = float(tolerance.get("k_se", DEFAULT_K_SE)) if k_se is None else k_se
    group_by = baseline.get("group_by")
    if group_by and group_by not in fits:
        raise BaselineError(f"the baseline holds one fit per {group_by!r}, the new fits have no "
                            f"such column; analyze with --group-by {group_by}")
    new_targets = fits["target"].to_numpy(float)
    groups = fits[group_by].astype(str).to_numpy() if group_by else np.full(len(fits), "")
    cases = []
    seen = np.zeros(len(fits), bool)
    for entry in baseline["targets"]:
        target, group = float(entry["target"]), str(entry.get("group", "")) if group_by else ""
        match = np.flatnonzero(np.isclose(new_targets, target, rtol=1e-9, atol=0.0)
                               & (groups == group))
        row = fits.iloc[match[0]] if len(match) else None
        seen[match] = True
        for name in FIGURES:
            cases.append(replace(_case(target, name, entry, row, rtol, k_se), group=group))
    for i in np.flatnonzero(~seen):
        row = fits.iloc[i]
        cases.append(Case(float(row["target"]), "b_crit", math.nan, float(row["b_crit"]), True,
                          "new target, not in the baseline", group=str(groups[i])))
    return cases


def _case(target: float, name: str, entry: dict[str, Any], row: Any, rtol: float,
          k_se: float) -> Case:
    old = entry.get(name)
    old = math.nan if old is None else float(old)
    if not math.isfinite(old):
        new = math.nan if row is None else float(row[name])
        return Case(target, name, old, new, True, "no fit in the baseline")
    if row is None:
        return Case(target, name, old, math.nan, False, "target missing from the new fits")
    new = float(row[name])
    if row["refused"] or not math.isfinite(new):
        return Case(target, name, old, new, False, f"no fit now: {row['refused'] or 'NaN'}")
    diff = abs(new - old)
    rel = diff / abs(old) if old else math.inf
    old_se = entry.get(f"{name}_se")
    se = math.hypot(float(old_se) if old_se is not None else math.nan, float(row[f"{name}_se"]))
    n_se = diff / se if math.isfinite(se) and se > 0 else math.inf
    ok = rel <= rtol or (k_se > 0 and n_se <= k_se)
    limits = f"rtol {rtol:g}" + (f", {k_se:g} se" if k_se > 0 else "")
    message = (f"{old:.6g} -> {new:.6g} ({rel:+.2%}"
               + (f", {n_se:.2f} se" if math.isfinite(n_se) else "") + f"; allowed {limits})")
    return Case(target, name, old, new, ok, message)


def junit_xml(cases: list[Case], suite: str = "gnsweep check") -> str:
    """JUnit XML: one test case per (target, figure), a failure element for each regression."""
    import xml.etree.ElementTree as ET

    failures = sum(not c.ok for c in cases)
    root = ET.Element("testsuites", name=suite, tests=str(len(cases)), failures=str(failures))
    node = ET.SubElement(root, "testsuite", name=suite, tests=str(len(cases)),
                         failures=str(failures), errors="0", skipped="0")
    for case in cases:
        group = f"{case.group}." if case.group else ""
        test = ET.SubElement(node, "testcase", classname=f"fits.{group}target_{case.target:g}",
                             name=case.figure)
        if not case.ok:
            failure = ET.SubElement(test, "failure", message=case.message, type="regression")
            failure.text = f"{case.label} {case.figure}: {case.message}"
        else:
            ET.SubElement(test, "system-out").text = case.message
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
