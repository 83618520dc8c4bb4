"""`gnsweep laws`'s report: one self-contained HTML page (OUT/laws.html) with the laws and their
intervals, the held-out check, the prediction, the cells, the figures embedded and the published
references, from laws.json's content. Writes no file (commands/laws.py does). `report_section`:
the section `gnsweep report` adds for a sweep that is a cell of a laws family."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from gnsweep import store
from gnsweep.paths import OutPaths, SweepPaths
from gnsweep.report.html import CSS, esc
from gnsweep.report.laws_text import QUANTITY_NAMES, format_laws

CAPTIONS = {
    "laws_fits": "Each law against D (or N): the cells it was fitted on (filled), cells left "
                 "out as edges (crosses), the held-out largest cell (open) with the prediction "
                 "of the fit made without it (black), and the law's 95% band.",
    "laws_landscapes": "Each cell's final loss over batch size and learning rate, coloured by "
                       "its excess over the cell's best; the near-optimal set ringed in red, "
                       "the optimum (local quadratic model) starred, diverged runs crossed.",
}


def _g(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}"


def render_laws(data: dict[str, Any], figures: dict[str, bytes | str]) -> str:
    """The page as one HTML string; `figures` maps a name to PNG bytes or why it was skipped."""
    parts = ["<!DOCTYPE html>", "<html lang=en><head><meta charset=utf-8>",
             "<title>Laws across scale</title>", f"<style>{CSS}</style></head><body>",
             "<h1>Batch size and learning rate laws across scale</h1>",
             "<p class=meta>Each (N, D) cell's optimum, power laws c N^a D^b fitted in log "
             "space with 95% bootstrap intervals, each checked on the largest cell held out. "
             "Written by <code>gnsweep laws</code> (docs/laws.md).</p>", "<h2>Laws</h2>",
             "<table><tr><th>quantity</th><th>form</th><th>coefficients [95%]</th>"
             "<th>held out (N, D)</th><th>predicted [95%]</th><th>measured</th></tr>"]
    for law in data["laws"]:
        coefs = "<br>".join(f"{esc(k)} = {_g(v['value'])} [{_g(v['low'])}, {_g(v['high'])}]"
                            for k, v in law["coefficients"].items())
        held = law["held_out"]
        predicted = (f"{_g(held['predicted'])} [{_g(held['predicted_low'])}, "
                     f"{_g(held['predicted_high'])}]" if held.get("predicted") is not None
                     else esc(held.get("refused", "")))
        target = (f" (target {law['target']:g})" if law.get("target") is not None
                  else f" ({law['scope']})" if law.get("scope") else "")
        parts.append(f"<tr><td>{esc(QUANTITY_NAMES.get(law['quantity'], law['quantity']))}"
                     f"{esc(target)}</td><td>{esc(law['form'])}<br><small>"
                     f"{esc('; '.join(law.get('form_reason', [])))}</small></td><td>{coefs}</td>"
                     f"<td>{_g(held['N'])}, {_g(held['D'])}</td><td>{predicted}</td>"
                     f"<td>{_g(held['measured'])}</td></tr>")
    parts.append("</table>")
    if data.get("refused"):
        parts.append("<ul class=warnings>" + "".join(
            f"<li>{esc(QUANTITY_NAMES.get(r['quantity'], r['quantity']))}: no law "
            f"({esc(r['reason'])})</li>" for r in data["refused"]) + "</ul>")
    for name, figure in figures.items():
        if isinstance(figure, bytes):
            encoded = base64.b64encode(figure).decode()
            parts.append(f"<figure><img src='data:image/png;base64,{encoded}' alt='{esc(name)}'>"
                         f"<figcaption>{esc(CAPTIONS.get(name, name))}</figcaption></figure>")
        else:
            parts.append(f"<p class=meta>{esc(name)} not drawn: {esc(figure)}</p>")
    parts += ["<h2>Summary</h2>", f"<pre>{esc(format_laws(data))}</pre>", "</body></html>"]
    return "\n".join(parts)


def report_section(sweep_dir: Path) -> str:
    """The HTML section `gnsweep report` adds for a sweep that is a cell of a laws family
    (`gnsweep laws` recorded where it wrote them): the printed laws and the fits figure; ""
    when the sweep is in no family."""
    import html

    pointer = SweepPaths(Path(sweep_dir)).laws_family
    if not pointer.is_file():
        return ""
    recorded = store.read_json(pointer)
    out = Path(str(recorded.get("laws", ""))) if isinstance(recorded, dict) else Path()
    head = "<h2>Laws across scale</h2>"
    laws_json = OutPaths(out).laws_json
    if not laws_json.is_file():
        return (f"{head}<p>This sweep is a cell of the laws written to "
                f"<code>{html.escape(str(out))}</code>, which are no longer there; run "
                "<code>gnsweep laws</code> again.</p>")
    text = format_laws(store.read_json(laws_json))
    figure = out / "laws_fits.png"
    image = (f'<img alt="laws" src="data:image/png;base64,'
             f'{base64.b64encode(figure.read_bytes()).decode()}">' if figure.is_file() else "")
    return (f"{head}<p>This sweep is a cell of a family whose laws <code>gnsweep laws</code> "
            f"wrote to <code>{html.escape(str(out))}</code> (docs/laws.md).</p>{image}"
            f"<pre>{html.escape(text)}</pre>")
