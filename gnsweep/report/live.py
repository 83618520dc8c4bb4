"""The live view of a sweep while it runs (`gnsweep report DIR --watch`): its progress and
every run's loss curve so far, on top of the report, the page reloading itself.

Pure: rows and curves in, a figure and HTML text out; `gnsweep.commands.report` reads the
folder and writes the page.
"""

from __future__ import annotations

import base64
import html
import math
import time
from collections import Counter
from typing import Any

import numpy as np

LIVE_STATES = ("pending", "queued", "running", "died", "rerun")
"""States of a run that a launch still has to run or is running: the sweep is not over."""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def curves_figure(curves: dict[str, tuple[np.ndarray, np.ndarray, int]]) -> Any:
    """Every run's smoothed loss so far against its step (run id -> (steps, losses, batch
    size)), one colour a batch size, the learning rates of a batch size told apart by their
    line style; None before any run has a row. One panel whatever the grid's size: the legend
    names batch sizes, not runs."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from gnsweep.report.figures import COLORS

    drawn = {k: v for k, v in curves.items() if len(v[0])}
    if not drawn:
        return None
    sizes = sorted({b for _, _, b in drawn.values()})
    colour = {b: COLORS[i % len(COLORS)] for i, b in enumerate(sizes)}
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(9, 4.2), layout="constrained")
    seen: Counter[int] = Counter()
    for run_id in sorted(drawn, key=lambda r: (drawn[r][2], r)):
        steps, losses, batch = drawn[run_id]
        ax.plot(steps, losses, styles[seen[batch] % len(styles)], color=colour[batch], lw=1.2)
        seen[batch] += 1
    ax.set_xscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("smoothed training loss")
    ax.set_title(f"{len(drawn)} run(s) so far")
    ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=colour[b], lw=2) for b in sizes]
    ax.legend(handles, [f"B={b:g}" for b in sizes], fontsize=8, ncols=max(1, len(sizes) // 8),
              title="batch size", title_fontsize=8, loc="upper right")
    return fig


def progress_parts(rows: list[dict[str, Any]], curves_png: bytes | None, every: float,
                   now: float | None = None) -> list[str]:
    """The live section: when it was written, the counts per state, a table of the runs not
    finished (step, examples, smoothed loss) and the curves figure."""
    now = time.time() if now is None else now
    counts = Counter(r["state"] for r in rows)
    over = not any(counts[s] for s in LIVE_STATES)
    stamp = time.strftime("%H:%M:%S", time.localtime(now))
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    parts = ["<section id=live><h2>Progress</h2>",
             f"<p class=meta id=progress data-runs={len(rows)} data-over={int(over)}>"
             f"{len(rows)} runs: {esc(summary)}; written at {esc(stamp)}"
             + ("; the sweep is over" if over else
                f"; this page reloads every {max(1, round(every))} s") + "</p>"]
    active = [r for r in rows if r["state"] in LIVE_STATES]
    if active:
        head = ["run", "state", "tries", "step", "examples", "smoothed loss"]
        body = []
        for r in active:
            loss = r.get("loss_smooth")
            cells = [r["run_id"], r["state"], r.get("attempts", ""),
                     "" if r.get("step") is None else f"{int(r['step']):,}",
                     "" if r.get("examples") is None else f"{int(r['examples']):,}",
                     f"{loss:.4g}" if isinstance(loss, int | float) and math.isfinite(loss)
                     else ""]
            body.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
        parts.append("<table id=runs-live><tr>" + "".join(f"<th>{h}</th>" for h in head)
                     + "</tr>" + "".join(body) + "</table>")
    failed = [r for r in rows if r["state"] == "failed"]
    if failed:
        parts.append("<ul class=warn>" + "".join(
            f"<li>{esc(r['run_id'])} failed: {esc(r.get('info', ''))}</li>" for r in failed)
            + "</ul>")
    if curves_png is not None:
        data = base64.b64encode(curves_png).decode("ascii")
        parts.append("<figure class=wide id=live-curves><img alt='loss curves so far' "
                     f"src='data:image/png;base64,{data}'><figcaption><b>loss curves so far"
                     "</b>: every run's smoothed training loss against its step</figcaption>"
                     "</figure>")
    parts.append("</section>")
    return parts


def waiting_page(title: str, live: list[str], reason: str, refresh: float | None) -> str:
    """The page before an analysis can be made (no run has reached anything yet): the live
    section and why there is no answer yet."""
    from gnsweep.report.html import CSS, refresh_tag

    return "\n".join([
        "<!DOCTYPE html>", "<html lang=en><head><meta charset=utf-8>",
        *([refresh_tag(refresh)] if refresh else []),
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>", *live,
        f"<h2>Answer</h2><p class=meta id=no-answer>No answer yet: {esc(reason)}</p>",
        "<script>window.addEventListener('load', () => { document.body.dataset.imagesLoaded"
        " = [...document.images].filter(i => i.complete && i.naturalWidth > 0).length; "
        "});</script>", "</body></html>"])
