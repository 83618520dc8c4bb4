"""A one-page, self-contained HTML report of a sweep: the answer, warnings, fits, figures, grid.

`render` is pure (tables and PNG bytes in, HTML text out; every piece of text is escaped); the
answer per target is `gnsweep.report.answers`'s. `gnsweep.commands.report` reads the sweep,
draws the figures and writes <sweep>/report.html.
"""

from __future__ import annotations

import base64
import html
import math
import struct
from typing import Any

import numpy as np
import pandas as pd

from gnsweep import redact
from gnsweep.analysis.along import tolerance_answer
from gnsweep.analysis.bounds import bound_text
from gnsweep.analysis.recipe_warnings import lr_law, recipe_of
from gnsweep.analysis.results import Results
from gnsweep.analysis.setting import Setting
from gnsweep.config import SCRIPT, Config, TrainConfig
from gnsweep.report.answers import along_answers, answers, interval_of
from gnsweep.report.views import preconditioned, quantity
from gnsweep.report.views import unit as unit_of
from gnsweep.targets import Direction
from gnsweep.tasks import about


def collect_warnings(tables: Results) -> list[str]:
    """Everything a reader should distrust: the analysis's warnings (grid edges, refused fits),
    unreached targets, and runs that failed, diverged or have not finished."""
    out = [w for w in tables.warnings
           if not (w.startswith("run ") and w.endswith(": left out"))]
    runs, steps = tables.runs, tables.steps
    target_of = quantity(tables.meta)
    for state, what in (("failed", "failed (see its status.json; relaunch to retry)"),
                        ("diverged", "diverged (loss blew up): left out of the fits"),
                        ("corrupt", "has an unreadable metrics file: left out"),
                        ("pending", "has not run yet: results are partial"),
                        ("running", "is still running: results are partial")):
        ids = sorted(runs.loc[runs["state"] == state, "run_id"]) if len(runs) else []
        if ids:
            out.append(f"{len(ids)} run(s) {what}: {', '.join(ids)}")
    if len(steps):
        for target, group in steps.groupby("target", sort=False):
            reached = group.groupby("batch_size")["reached"].any()
            never = [int(b) for b in reached.index[~reached]]
            if len(never) == len(reached):
                out.append(f"target {target:g}: no run reached it; raise sweep.max_steps or "
                           + ("choose a higher target loss" if target_of == "loss"
                              else f"choose a lower target {target_of}"))
            elif never:
                out.append(f"target {target:g}: batch size(s) {', '.join(map(str, never))} "
                           "never reached it at any learning rate")
    return out


# ---- HTML ----------------------------------------------------------------------------------

CSS = """
body { font-family: 'DejaVu Sans', Helvetica, Arial, sans-serif; color: #1a1a1a;
       max-width: 1100px; margin: 2em auto; padding: 0 1em; line-height: 1.45; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.8em;
  border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
.meta { color: #555; font-size: 0.9em; }
.answer { background: #eef5fb; border-left: 4px solid #0072B2; padding: 0.5em 0.9em;
          margin: 0.4em 0; }
.warn li { color: #8a3b00; } .note li { color: #555; }
table { border-collapse: collapse; font-size: 0.88em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; } td.text { text-align: left; }
.figures { display: grid; grid-template-columns: repeat(auto-fit, minmax(460px, 1fr));
           gap: 1.2em; }
figure { margin: 0; } figure.wide { grid-column: 1 / -1; }
figure img { width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.88em; color: #444; }
pre { background: #f7f7f7; padding: 0.7em; font-size: 0.82em; overflow-x: auto; }
"""


PAGE_WIDE_PX = 1300
"""A figure this many pixels wide was drawn a page wide (report.figures.PAGE inches at 200
dpi is 1400): the report shows it across the page."""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def refresh_tag(seconds: float) -> str:
    """The head's tag that reloads the page every `seconds` (the live view)."""
    return f"<meta http-equiv=refresh content='{max(1, round(seconds))}'>"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def _pm(value: float, se: float) -> str:
    if not math.isfinite(value):
        return ""
    return f"{value:.4g} ± {se:.2g}" if math.isfinite(se) else f"{value:.4g}"


def _bcrit_cell(row: Any) -> str:
    """B_crit with its error, or the bound it is ("> 8192"), never a runaway value."""
    bound = bound_text(str(getattr(row, "bcrit_status", "")),
                       float(getattr(row, "b_crit_bound", math.nan)))
    return bound or _pm(row.b_crit, row.b_crit_se)


def _num(value: float, fmt: str = ".3g") -> str:
    return format(value, fmt) if isinstance(value, int | float) and math.isfinite(value) else ""


def _has(fits: pd.DataFrame, column: str) -> bool:
    return column in fits and bool(np.isfinite(fits[column].astype(float)).any())


def fit_table(fits: pd.DataFrame, what: str = "loss", unit: str = "examples") -> str:
    has_noise = _has(fits, "b_noise_mean")
    has_window = _has(fits, "b_crit_window_spread")
    has_precond = preconditioned(fits)  # an adaptive optimizer's B_simple_P, not SGD's copy
    true = [c for c in ("b_simple_true_mean", "b_noise_true_mean") if _has(fits, c)]
    head = [f"target {what}", "batch sizes", "S_min (steps)", f"E_min ({unit})",
            f"B_crit ({unit})", "B_crit 95% interval",
            *(["B_crit at half / double smoothing window"] if has_window else []),
            "B_simple (S_min-weighted mean)",
            *(["B_simple exact (same runs)"] if "b_simple_true_mean" in true else []),
            "B_simple at target", *(["B_noise"] if has_noise else []),
            *(["B_noise exact (same runs)"] if "b_noise_true_mean" in true else []),
            "B_crit / B_simple",
            *(["B_simple_P (preconditioned)", "B_crit / B_simple_P"] if has_precond else []),
            "rms log residual", "note"]
    rows = []
    for row in fits.sort_values("target", ascending=False).itertuples(index=False):
        lo, hi = interval_of(row)
        cells = [f"{row.target:g}", f"{row.n_batch_sizes}", _pm(row.s_min, row.s_min_se),
                 _pm(row.e_min, row.e_min_se), _bcrit_cell(row),
                 f"{lo:.3g} to {hi:.3g}" if math.isfinite(lo) else "",
                 *([f"{_num(row.b_crit_window_lo)} / {_num(row.b_crit_window_hi)} "
                    f"({_num(100 * row.b_crit_window_spread, '.0f')}%)"] if has_window else []),
                 _num(row.b_simple_mean),
                 *([_num(row.b_simple_true_mean)] if "b_simple_true_mean" in true else []),
                 _num(row.b_simple_at_target),
                 *([_num(row.b_noise_mean)] if has_noise else []),
                 *([_num(row.b_noise_true_mean)] if "b_noise_true_mean" in true else []),
                 _num(row.ratio, ".2f"),
                 *([_num(row.b_simple_precond_mean), _num(row.ratio_precond, ".2f")]
                   if has_precond else []),
                 _num(row.rmse_log), str(row.refused or "")]
        rows.append("<tr>" + "".join(
            f"<td{' class=text' if i == len(cells) - 1 else ''}>{esc(c)}</td>"
            for i, c in enumerate(cells)) + "</tr>")
    header = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"
    return f"<table>{header}{''.join(rows)}</table>"


def lr_form_lines(lr_fits: pd.DataFrame) -> list[str]:
    """Which law the best learning rates follow per target (`form` of lr_fits.parquet: the
    lowest AICc of eq. 2.7, its saturating power law, and Li et al.'s surge), where one was
    fitted."""
    if "form" not in lr_fits or not (lr_fits["form"].astype(str) != "").any():
        return []
    names = {"sgd": "eq. 2.7, eps_max/(1 + B_noise/B)",
             "power": "saturating, eps_max/(1 + (B_noise/B)^alpha)",
             "surge": "surge (Li et al. 2024): peaks at B_noise, falls after"}
    items = []
    for target, rows in lr_fits.groupby("target", sort=False):
        form = str(rows["form"].iloc[0])
        if form:
            chosen = rows[rows["model"] == form].iloc[0]
            items.append(f"target {target:g}: {names.get(form, form)}, B_noise "
                         f"{_num(chosen['b_noise'])} (lowest AICc of "
                         f"{int((rows['refused'] == '').sum())} fitted forms)")
    return ["<h3>Best learning rate against batch size: the form that fits</h3>",
            _list(items, "note")]


def adaptive_section(table: pd.DataFrame, unit: str = "examples") -> list[str]:
    """Adaptive batch size runs (appendix D) against the fits: gamma, predicted and measured
    gain in examples at equal steps; nothing without adaptive runs."""
    if table is None or not len(table):
        return []
    head = ["target", "run", "exchange rate r", "S (steps)", f"E ({unit})", "mean B",
            "gamma", "gain predicted", "gain measured", "(S/S_min−1)(E/E_min−1)"]
    rows = []
    for row in table.itertuples(index=False):
        cells = [f"{row.target:g}", str(row.run_id), f"{row.exchange_rate:g}"]
        if row.reached:
            cells += [_num(row.steps), _num(row.examples), _num(row.mean_batch),
                      f"{_num(row.gamma)} ({row.noise_source})", _num(row.gain_predicted),
                      _num(row.gain_measured), _num(row.front_product)]
        else:
            cells += [f"not reached ({row.state})", "", "", "", "", "", ""]
        rows.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
    header = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"
    return ["<h2>Adaptive batch size (appendix D): (S/S_min − 1)(E/E_min − 1) = γ</h2>",
            "<p class=meta>B = sqrt(r B_noise) each step (B_simple standing in for B_noise "
            "unless measured), learning rate eps_max/(1 + B_noise/B) (eq. 2.7). γ = "
            "⟨√B_noise⟩²/⟨B_noise⟩ over the run's own noise path, S_min-weighted; gain = "
            "E of a fixed batch size at the same S (from the fit) / E.</p>",
            f"<table>{header}{''.join(rows)}</table>"]


def along_section(table: pd.DataFrame, figures: dict[str, bytes | str] | None = None,
                  what: str = "loss", unit: str = "examples",
                  caption: str = "") -> list[str]:
    """A branch sweep's answer per branch point (`answers.along_answers`: each named by its
    point), its local B_crit per point and target beside the base run's noise scale there and
    the tolerance rule's, and the along-training figure; nothing for any other sweep."""
    if table is None or not len(table):
        return []
    head = [f"branch point ({unit})", "steps", f"{what} there", "target", f"target {what}",
            "batch sizes", "S_min (steps)", f"E_min ({unit})", f"local B_crit ({unit})",
            f"by tolerance ({unit})", "base B_simple", "base B_noise", "B_crit / B_simple",
            "note"]
    rows = []
    for row in table.sort_values(["at_examples", "target"], ascending=[True, False]
                                 ).itertuples(index=False):
        note = str(row.refused or row.quality or "")
        tolerance = tolerance_answer(row, "").strip() if hasattr(row, "b_crit_tol") else ""
        cells = [f"{row.at_examples:,}", f"{row.at_step:,}", _num(row.at_loss, ".4g"),
                 _num(row.target, ".4g"), _num(row.target_value, ".4g"),
                 str(row.n_batch_sizes), _pm(row.s_min, row.s_min_se),
                 _pm(row.e_min, row.e_min_se), _bcrit_cell(row), tolerance,
                 _num(row.b_simple), _num(row.b_noise), _num(row.ratio, ".2f"), note]
        rows.append("<tr>" + "".join(
            f"<td{' class=text' if i in (9, len(cells) - 1) else ''}>{esc(c)}</td>"
            for i, c in enumerate(cells)) + "</tr>")
    header = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"
    parts = ["<h2>Critical batch size along training (branch sweep)</h2>",
             *(f"<p class=answer>{esc(a)}</p>" for a in along_answers(table, unit, what)),
             "<p class=meta>Short runs branched from the base run's checkpoints, each branch "
             f"point a sweep of its own to targets relative to its {esc(what)} (target = "
             "fraction of it; chosen from what the runs reached unless branch.targets sets "
             "them); local B_crit = E_min/S_min of eq. 2.11-2.12 with its standard error, and "
             "by tolerance (Merrill et al. 2025: the largest batch size whose loss after the "
             "window the best smaller one reached within the tolerance's share of the "
             "window), beside the base run's B_simple (eq. 2.9) and B_noise (eq. 2.8) at the "
             "point (docs/along.md).</p>",
             f"<table>{header}{''.join(rows)}</table>"]
    for name, item in (figures or {}).items():
        if isinstance(item, str):
            parts.append(f"<p class=meta>skipped {esc(name)}: {esc(item)}</p>")
            continue
        data = base64.b64encode(item).decode("ascii")
        parts.append(f"<figure id={esc(name)}><img alt='{esc(name)}' "
                     f"src='data:image/png;base64,{data}'><figcaption><b>{esc(name)}</b>"
                     f"{': ' + esc(caption) if caption else ''}</figcaption></figure>")
    return parts


def recipe_words(train: TrainConfig, unit: str = "examples") -> str:
    """The recipe in words, what differs from plain fp32 training at a constant rate
    (e.g. "adamw, weight decay 0.1, warmup 2e+04 examples, cosine decay to 0.1x, clip 1,
    bf16, micro-batches of 64"), with the warmup and decay in the task's `unit` (what
    they count)."""
    parts = [train.optimizer + (f" (momentum {train.momentum:g})" if train.momentum else "")]
    if train.weight_decay:
        parts.append(f"weight decay {train.weight_decay:g}")
    if train.warmup_steps or train.warmup_examples:
        parts.append(f"warmup {train.warmup_steps or train.warmup_examples:g} "
                     + ("steps" if train.warmup_steps else unit))
    if train.decay != "constant":
        parts.append(f"{train.decay} decay to {train.min_lr_ratio:g}x"
                     + (f" over {train.decay_examples:g} {unit}" if train.decay_examples
                        else " over the run's budget"))
    if train.grad_clip:
        parts.append(f"clip {train.grad_clip:g}")
    if train.precision != "fp32":
        parts.append(train.precision)
    if train.microbatch_size:
        parts.append(f"micro-batches of {train.microbatch_size}"
                     + (" samples" if unit != "examples" else ""))
    return ", ".join(parts)


def grid_summary(config: Config, runs: pd.DataFrame) -> str:
    """The grid as run. Batch sizes in the task's unit, as every other number of the report
    (the analysis's runs table counts them so), with the samples per step the config names
    beside them where the unit differs (an LM's windows)."""
    sweep = config.sweep
    unit = about(config.task).unit
    batches = ", ".join(map(str, sweep.batch_sizes))
    counted = sorted({int(b) for b in runs["batch_size"]}) if len(runs) and \
        "batch_size" in runs else []
    if counted and counted != sorted(sweep.batch_sizes):
        batches = (f"{', '.join(f'{b:,}' for b in counted)} {unit} "
                   f"({batches} samples per step)")
    elif unit != "examples":
        batches = f"{batches} {unit}"
    script = config.task.name == SCRIPT
    items = [("task", about(config.task).label),
             *([("command", str(config.task.options.get("command", "")))] if script else []),
             ("training", recipe_of(config).words() if script
              else recipe_words(config.train, unit)),
             ("batch sizes", batches),
             ("learning rates", ", ".join(f"{x:g}" for x in sweep.learning_rates)),
             ("seeds", ", ".join(map(str, sweep.seeds))),
             ("target " + ("losses" if about(config.task).metric == "loss" else
                           f"{about(config.task).metric}s"),
              ", ".join(map(str, sweep.targets)) or "auto (from the runs)"),
             ("max steps per run", sweep.max_steps)]
    states = runs["state"].value_counts().to_dict() if len(runs) else {}
    items.append(("runs", f"{len(runs)}: " + ", ".join(f"{n} {s}" for s, n in
                                                     sorted(states.items()))))
    body = "".join(f"<tr><th>{esc(k)}</th><td class=text>{esc(v)}</td></tr>" for k, v in items)
    return f"<table>{body}</table>"


def _list(items: list[str], cls: str) -> str:
    return f"<ul class={cls}>" + "".join(f"<li>{esc(i)}</li>" for i in items) + "</ul>"


def render(tables: Results, figures: dict[str, bytes | str], config: Config | None,
           config_text: str, title: str, notes: list[str] | None = None,
           groups: dict[str, tuple[Results, dict[str, bytes | str], list[str]]] | None = None,
           along_figures: dict[str, bytes | str] | None = None, *,
           live: list[str] | None = None, refresh: float | None = None) -> str:
    """The report as one HTML string. `figures` maps a figure name to PNG bytes or to the
    one-line reason it was skipped; images are embedded as base64 data URIs. `groups` (an
    analysis `--group-by`): one section per group, each with its own tables, figures and notes.
    Without `config` (measurements from a table) the grid is the table's source. `live`: the
    live view's progress section (`report.live`) after the title; `refresh`: the page reloads
    itself every that many seconds (while a sweep runs)."""
    parts = [
        "<!DOCTYPE html>", "<html lang=en><head><meta charset=utf-8>",
        *([refresh_tag(refresh)] if refresh else []),
        f"<title>{esc(title)}</title>",
        "<meta name=viewport content='width=device-width, initial-scale=1'>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        "<p class=meta>Critical batch size from a batch size x learning rate sweep "
        "(McCandlish et al. 2018, eq. 2.11-2.12). Written by <code>gnsweep report</code>.</p>",
    ]
    law = lr_law(config)[1] if config is not None else ""
    if config is not None and config.task.name == SCRIPT:
        command = redact.text(str(config.task.options.get("command", "")))
        parts.append(f"<p class=meta id=command>Command: <code>{esc(command)}</code></p>")
    parts += live or []
    along_caption = ""
    if len(tables.along):
        from gnsweep.report.figures import ALONG_FIGURE

        along_caption = ALONG_FIGURE.caption_for(tables)
    parts += along_section(tables.along, along_figures, quantity(tables.meta),
                           unit_of(tables.meta), along_caption)
    if groups:
        column = tables.meta.get("group_by", "group")
        for name, (part, part_figures, part_notes) in groups.items():
            parts += [f"<h1 class=group id='{esc(name)}'>{esc(column)} {esc(name)}</h1>",
                      *_section(part, part_figures, part_notes, law)]
    else:
        parts += _section(tables, figures, notes, law)
    if config is not None:
        parts += ["<h2>Grid</h2>", grid_summary(config, tables.runs),
                  "<h2>Resolved configuration</h2>", f"<pre>{esc(redact.text(config_text))}</pre>"]
    else:
        parts += ["<h2>Source</h2>", f"<pre>{esc(redact.text(config_text))}</pre>"]
    # Lets a headless browser test see that every embedded figure decoded.
    parts += ["<script>window.addEventListener('load', () => { document.body.dataset.imagesLoaded"
              " = [...document.images].filter(i => i.complete && i.naturalWidth > 0).length; "
              "});</script>",
              "</body></html>"]
    return "\n".join(parts)


def recommendation_box(tables: Results) -> list[str]:
    """The setting to train with (`analysis.decision`, balanced), first in the answer box;
    nothing for a branch sweep (its answer is per branch point) or without fits."""
    from gnsweep.analysis.decision import recommend
    from gnsweep.report.recommendation import summary

    if len(tables.along) or not len(tables.fits):
        return []
    rec = tables.recommendation or recommend(tables).to_json()
    return [f"<p class=answer><b>{esc(summary(rec, quantity(tables.meta)))}</b></p>"]


def _section(tables: Results, figures: dict[str, bytes | str], notes: list[str] | None,
             law: str = "") -> list[str]:
    """Answer, warnings, fits and figures of one analysis; `law`: whether the learning-rate
    law of eq. 2.7 applies to the runs' recipe (`analysis.recipe_warnings.lr_law`)."""
    from gnsweep.report.figures import FIGURES  # captions; matplotlib only once a report is drawn

    captions = {spec.name: spec.caption_for(tables) for spec in FIGURES}
    warnings = collect_warnings(tables)
    unit = unit_of(tables.meta)
    parts = [
        "<h2>Answer</h2>",
        *recommendation_box(tables),
        *(f"<p class=answer>{esc(a)}</p>"
          for a in answers(tables.fits, tables.front, quantity(tables.meta), unit,
                              Direction.from_meta(tables.meta),
                              Setting.from_meta(tables.meta).smallest)),
        f"<h2>Warnings ({len(warnings)})</h2>",
        _list(warnings, "warn") if warnings else "<p>None.</p>",
        "<h2>Fits of eq. 2.11: (S/S_min − 1)(E/E_min − 1) = 1</h2>",
        "<p class=meta>Standard errors from the least-squares Jacobian on log S; "
        "B_crit = E_min/S_min (eq. 2.12), its error by the delta method.</p>",
        fit_table(tables.fits, quantity(tables.meta), unit),
        *([f"<p class=meta id=lr-law>{esc(law[0].upper() + law[1:])}.</p>"] if law else []),
        *lr_form_lines(tables.lr_fits),
        *adaptive_section(tables.adaptive, unit),
        "<h2>Figures</h2><div class=figures>",
    ]
    skipped = []
    for name, item in figures.items():
        if isinstance(item, str):
            skipped.append(f"{name}: {item}")
            continue
        width, height = png_size(item)
        # A wide figure, or one drawn a page wide (a grid with many rows), takes the full width:
        # in half of it its text would be too small to read.
        wide = " class=wide" if width > 1.6 * height or width >= PAGE_WIDE_PX else ""
        data = base64.b64encode(item).decode("ascii")
        caption = captions.get(name, name)
        parts.append(f"<figure{wide} id={esc(name)}><img alt='{esc(caption)}' "
                     f"src='data:image/png;base64,{data}'>"
                     f"<figcaption><b>{esc(name)}</b>: {esc(caption)}</figcaption></figure>")
    parts.append("</div>")
    if skipped or notes:
        parts += ["<h3>Not drawn, or drawn without a part</h3>",
                  _list([*(f"skipped {s}" for s in skipped), *(notes or [])], "note")]
    return parts
