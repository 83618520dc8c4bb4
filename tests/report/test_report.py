"""The HTML report: the plain answer per target (numbers from eq. 2.11-2.12 worked by hand),
warnings, escaping, embedded figures; then `gnsweep plot` and `gnsweep report` on a real tiny
sweep, and the report opened in headless chromium."""

from __future__ import annotations

import base64
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.image as mpimg
import matplotlib.pyplot as plt
import numpy as np
import pytest
from locations import ROOT
from sweep_tables import make_tables
from typer.testing import CliRunner

from gnsweep.analysis.fit import predict_steps
from gnsweep.cli import app
from gnsweep.config import Config
from gnsweep.report import figures as plots
from gnsweep.report.answers import answers, rounded
from gnsweep.report.figures import png_bytes
from gnsweep.report.html import collect_warnings, render

runner = CliRunner()


def test_rounded_to_two_significant_figures():
    assert rounded(74.13) == "74"
    assert rounded(1126.0) == "1,100"
    assert rounded(0.01234) == "0.012"
    assert rounded(9.96) == "10"
    assert rounded(math.nan) == "?"


def test_answer_per_target_worked_by_hand():
    text = answers(make_tables().fits, make_tables().front)
    # Highest loss first. Target 1: S_min = 10, E_min = 500, B_crit = 50 +- 5; the 95% interval
    # on log B_crit is 50 * exp(-+1.96 * 0.1) = 41.1 to 60.8.
    assert text[0].startswith("At loss 1 the largest useful batch size is about 50 (41 to 61); "
                              "beyond it, doubling the batch saves less than half the steps that "
                              "perfect scaling would save (under a quarter of them).")
    assert "about 20 steps and 1,000 examples" in text[0]  # 2 S_min, 2 E_min
    # Target 0.25: B_crit = 100 +- 10 -> 82 to 120.
    assert "At loss 0.25 the largest useful batch size is about 100 (82 to 120)" in text[2]
    assert "extrapolated" not in " ".join(text)  # 50..100 lie within the batch sizes 8..256
    assert "B_simple, was about 40" in text[0]


def test_the_sentence_is_what_eq_2_11_says():
    # S(B) = S_min + E_min/B: doubling at B_crit saves exactly a quarter of the steps, beyond it
    # less; perfect scaling (S proportional to 1/B) saves half.
    s_min, e_min = 10.0, 500.0
    b_crit = e_min / s_min
    for factor, saved in ((1, 1 / 4), (2, 1 / 6), (4, 1 / 10)):
        b = factor * b_crit
        before, after = predict_steps(b, s_min, e_min), predict_steps(2 * b, s_min, e_min)
        assert (before - after) / before == pytest.approx(saved)
        assert saved <= 1 / 4


def test_bootstrap_interval_is_preferred_when_present():
    tables = make_tables()
    tables.fits["b_crit_lo"], tables.fits["b_crit_hi"] = 30.0, 90.0
    assert "about 50 (30 to 90)" in answers(tables.fits, tables.front)[0]


def test_refused_and_extrapolated_targets_say_so():
    tables = make_tables()
    tables.fits.loc[0, ["b_crit", "s_min", "e_min"]] = math.nan
    tables.fits.loc[0, "refused"] = "only 2 batch size(s) reached the target; the fit needs 3"
    tables.fits.loc[1, ["b_crit", "b_crit_se"]] = [300.0, 30.0]  # just above B = 256
    tables.fits.loc[2, ["b_crit", "b_crit_se"]] = [1000.0, 100.0]  # far above: a bound
    text = answers(tables.fits, tables.front)
    assert text[0] == ("At loss 1: no answer yet; only 2 batch size(s) reached the target; "
                       "the fit needs 3.")
    assert "about 300 (250 to 360)" in text[1]
    assert ("outside the batch sizes that reached this target (8 to 256): it is extrapolated, "
            "the sweep only bounds it") in text[1]
    # 1000 * exp(-+1.96 * 0.1) = 822 to 1217.
    assert text[2].startswith("At loss 0.25 the largest useful batch size is beyond the largest "
                              "one that reached it (256): the fit puts it near 1,000 (95% "
                              "interval 820 to 1,200), an extrapolation. Add larger batch sizes")
    tables.fits.loc[2, ["b_crit", "b_crit_se"]] = [2.0, 1e6]  # far below, and no error bar
    text = answers(tables.fits, tables.front)
    assert "is below the smallest one that reached it (8)" in text[2]
    assert "(95% interval 0 to infinity)" in text[2]


def test_warnings_name_diverged_runs_and_unreached_targets():
    tables = make_tables()
    unreached = (tables.steps["batch_size"] == 256) & (tables.steps["target"] == 0.25)
    tables.steps.loc[unreached, ["reached", "steps"]] = [False, math.nan]
    tables.runs.loc[0, "state"] = "failed"
    warnings = collect_warnings(tables)
    assert "target 1: best learning rate on the edge of the grid" in warnings
    assert "2 run(s) diverged (loss blew up): left out of the fits: b00008_lr3_s0, b00016_lr3_s0" \
        in warnings
    assert any(w.startswith("1 run(s) failed") and "b00008_lr0.1_s0" in w for w in warnings)
    assert "target 0.25: batch size(s) 256 never reached it at any learning rate" in warnings


@pytest.fixture(scope="module")
def html_text():
    tables = make_tables()
    tables.warnings.append("<script>alert('x')</script> & more")
    figures: dict[str, bytes | str] = {}
    for name, fig in plots.draw_all(tables).items():
        figures[name] = png_bytes(fig)
        plt.close(fig)
    figures["bcrit_vs_loss"] = "1 target(s) with a fit of eq. 2.11; a trend needs at least 2"
    config = Config.from_dict({"sweep": {"batch_sizes": [8, 16], "targets": [1.0]}})
    return render(tables, figures, config,
                  "sweep:\n  name: <b>synthetic</b>\n", "report <synthetic>", ["a note"])


def test_report_escapes_every_text(html_text):
    assert "<script>alert" not in html_text
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; more" in html_text
    assert "<b>synthetic</b>" not in html_text and "&lt;b&gt;synthetic&lt;/b&gt;" in html_text
    assert "<title>report &lt;synthetic&gt;</title>" in html_text


def test_report_embeds_figures_and_is_self_contained(html_text):
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", html_text)
    assert len(images) == len(plots.FIGURES) - 1
    for data in images:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    assert not re.search(r"(src|href)=['\"]?(https?:|//|file:)", html_text)
    assert "skipped bcrit_vs_loss: 1 target(s)" in html_text
    assert "a note" in html_text
    for heading in ("Answer", "Warnings", "Fits of eq. 2.11", "Figures", "Grid",
                    "Resolved configuration"):
        assert f"<h2>{heading}" in html_text
    assert "50 ± 5" in html_text  # B_crit with its standard error in the fit table


# ---- a real sweep through the CLI, and a real browser -------------------------------------


# Both tests read one `gnsweep plot` and one `gnsweep report` of the module's tiny sweep (each
# draws every figure): on one xdist worker, so that they are drawn once.
REPORTED = pytest.mark.xdist_group("report_tiny_sweep")


@pytest.fixture(scope="module")
def reported(tiny_sweep) -> tuple[str, str]:
    """`gnsweep plot`, then `gnsweep report`, on the launched (not yet analysed) tiny sweep:
    their outputs."""
    plotted = runner.invoke(app, ["plot", str(tiny_sweep)])
    assert plotted.exit_code == 0, plotted.output
    reported = runner.invoke(app, ["report", str(tiny_sweep)])
    assert reported.exit_code == 0, reported.output
    return plotted.output, reported.output


@pytest.mark.slow
@REPORTED
def test_plot_and_report_commands_on_a_real_sweep(tiny_sweep, reported):
    plotted, reported_output = reported
    skipped = set(re.findall(r"skipped (\w+): ", plotted))
    drawn = [spec.name for spec in plots.FIGURES if spec.name not in skipped]
    assert "pareto_fronts" in drawn and "loss_curves" in drawn and "bcrit_vs_bsimple" in drawn
    for name in drawn:
        for ext in ("png", "pdf"):
            path = tiny_sweep / "figures" / f"{name}.{ext}"
            # The two figures the answer rests on hold their data, not an empty frame.
            least = 5000 if name in ("pareto_fronts", "bcrit_vs_bsimple") else 2000
            assert path.stat().st_size > least, path
    assert (tiny_sweep / "report.html").resolve().as_uri() in reported_output
    text = (tiny_sweep / "report.html").read_text()
    assert text.count("data:image/png;base64,") == len(drawn)
    assert "the largest useful batch size is about" in text or "no answer yet" in text
    # Titled by the task it trained (the sweep file is "tiny"); its targets are losses.
    assert f"<title>gnsweep report: digits ({tiny_sweep})</title>" in text
    assert "<th>target losses</th>" in text and "losss" not in text
    # Plot (which analyses the sweep first) then report: each note said once between them.
    notes = [line for line in plotted.splitlines() + reported_output.splitlines()
             if line.startswith("note:")]
    assert len(notes) == len(set(notes))


def test_report_of_a_missing_folder_is_one_line(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "no such folder" in result.output


def chromium() -> str:
    """Debian's chromium; installed by scripts/install-chromium.sh when missing (as in CI)."""
    found = shutil.which("chromium") or ("/usr/bin/chromium"
                                         if os.path.exists("/usr/bin/chromium") else None)
    if not found:
        subprocess.run(["bash", str(ROOT / "scripts" / "install-chromium.sh")], check=True)
        found = "/usr/bin/chromium"
    return found


def headless(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    profile.mkdir(exist_ok=True)
    return subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.browser
@REPORTED
def test_report_renders_in_headless_chromium(tiny_sweep, reported, tmp_path):
    page = (tiny_sweep / "report.html").resolve().as_uri()
    n_figures = (tiny_sweep / "report.html").read_text().count("data:image/png;base64,")
    # Every embedded figure decoded: the page's load handler counts images with a width.
    # The virtual-time budget lets the load handler run before the DOM is dumped.
    dom = headless(tmp_path, "--virtual-time-budget=10000", "--dump-dom", page)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert f'data-images-loaded="{n_figures}"' in dom.stdout
    assert "largest useful batch size" in dom.stdout or "no answer yet" in dom.stdout

    shot = tmp_path / "report.png"
    run = headless(tmp_path, f"--screenshot={shot}", "--window-size=1200,3000", page)
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    image = mpimg.imread(shot)[..., :3]
    assert image.shape[:2] == (3000, 1200)
    assert (image < 0.9).any(axis=-1).mean() > 0.05  # text and figures, not a blank page
    # The figures' colours are on screen: Okabe-Ito orange marks the second target only in the
    # figures (the page's own styles use none).
    orange = np.array([0xE6, 0x9F, 0x00]) / 255
    assert (np.abs(image - orange).max(axis=-1) < 0.06).sum() > 50
