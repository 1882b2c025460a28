"""ui/html_page.py, ui/figures.py and ui/run_data.py as a newcomer reads the page in the first hour: the verdict of
a run --fix repaired, tables and axes that say where steps were left out, the loss, one unit per colour bar, code
spans, and the findings counted as the console lists them."""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

import ampdoctor
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.report import Report
from ampdoctor.ui.console import render_report
from ampdoctor.ui.demo import DEMO_SCRIPT
from ampdoctor.ui.figures import draw_figures, have_matplotlib
from ampdoctor.ui.html_page import verdict
from ampdoctor.ui.report_files import Loaded, combine, load_any, render_html, run_data

needs_matplotlib = pytest.mark.skipif(not have_matplotlib(), reason="matplotlib is not installed")


def _section(page: str, start: str, end: str) -> str:
    at = page.index(start)
    return page[at:page.index(end, at)]


def _text(page: str) -> str:
    """The page as a reader sees it: without its figures and preformatted blocks (code, tracebacks), tags dropped."""
    page = re.sub(r"<svg.*?</svg>|<pre.*?</pre>|<style>.*?</style>", "", page, flags=re.S)
    return re.sub(r"<[^>]+>", " ", page)


@pytest.fixture(scope="module")
def fixed_run(tmp_path_factory) -> tuple[Path, Path, str]:
    """`ampdoctor run --fix --json --log-dir` of the demo script (a model cast with .half()): the JSON report, the
    flight recorder, and what the console said."""
    folder = tmp_path_factory.mktemp("fixed")
    script = folder / "train.py"
    script.write_text(DEMO_SCRIPT, encoding="utf-8")
    report, logs = folder / "f.json", folder / "logs"
    done = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--fix", "--json", str(report), "--log-dir",
                           str(logs), str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and report.is_file(), done.stdout[-2000:] + done.stderr[-2000:]
    return report, logs / "ampdoctor.jsonl", " ".join(done.stderr.split())


def test_a_fixed_run_closes_green_with_what_was_verified_and_what_the_script_still_has(fixed_run):
    """The page's verdict bar was empty and yellow: the repaired findings stay as info, and the closing sentence
    gave way to any finding. Now it closes as the console does, with what the watch verified."""
    report, log, console = fixed_run
    said = re.search(r"ampdoctor: (no findings left after 4 changes by --fix; what it repaired \(AMP101, AMP104\) "
                     r"is still in the script)", console)
    assert said, console[-1500:]
    for loaded in (load_any(str(report)), load_any(str(log)), combine(load_any(str(log)), load_any(str(report)))):
        kind, lines = verdict(loaded, run_data(loaded))
        assert kind == "ok" and len(lines) == 1, lines
        assert lines[0].startswith(said.group(1) + "; no mixed-precision problems found in 40 steps: ")
        page = render_html(loaded)
        bar = _section(page, "<section id='verdict'", "</section>")
        assert "class='verdict ok'" in bar and "what it repaired (AMP101, AMP104) is still in the script" in bar


def test_a_fixed_runs_page_draws_its_loss(fixed_run):
    """The loss is in the flight recorder's step lines; the page had no plot of it."""
    _, log, _ = fixed_run
    recorded = [(line["step"], line["loss"]["value"]) for line in map(json.loads, log.read_text().splitlines())
                if line.get("type") == "step" and isinstance(line.get("loss"), dict)]
    assert len(recorded) >= 10 and recorded[0][1] > recorded[-1][1]   # it trains: the loss falls
    loaded = load_any(str(log))
    assert run_data(loaded).loss == recorded
    if have_matplotlib():
        [loss] = [f for f in draw_figures(run_data(loaded)) if f.key == "loss"]
        line = loss.figure.axes[0].lines[0]
        assert list(zip(line.get_xdata(), line.get_ydata())) == recorded
        assert "id='fig-loss'><svg" in render_html(loaded)


def collapse_run(log_dir: Path) -> None:
    """Train 60 steps whose loss, sqrt(0), has a NaN gradient: the GradScaler halves its scale at every step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(32, 8)
    with ampdoctor.watch(model, opt, scaler, log_dir=str(log_dir)):
        for _ in range(60):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
                loss = torch.sqrt((out - out.detach()).pow(2).mean())
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


@pytest.fixture(scope="module")
def collapse_log(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("collapse")
    collapse_run(folder)
    return folder / "ampdoctor.jsonl"


def test_the_loss_scale_table_says_which_steps_it_leaves_out(collapse_log):
    """61 scale changes: the table showed steps 0-4, then 46-60, with nothing between the rows to say so."""
    page = render_html(load_any(str(collapse_log)))
    table = _section(page, "<h3>Loss scale</h3>", "</table>")
    cells = re.findall(r"<tr(?: class='gap')?><td(?: colspan='2')?>(.*?)</td>", table)
    assert cells[0] == "0" and any(c.startswith("…") for c in cells), cells
    following = 0   # the first step the next row must cover: the rows and the gap rows cover every step, in order
    for cell in cells:
        if cell.startswith("…"):
            left_out = re.fullmatch(r"… (\d+) changes of the scale in steps (\d+)–(\d+) not shown", cell)
            assert left_out and int(left_out.group(2)) == following, cell
            following = int(left_out.group(3)) + 1
        elif cell.startswith("after step "):
            assert int(cell.removeprefix("after step ")) == following - 1 == 59
        else:
            first, _, last = cell.partition("–")
            assert int(first) == following, (cell, following)
            following = int(last or first) + 1


def _heatmap_images(figures: list) -> list:
    return [image for f in figures if f.key.startswith(("cast_", "nonfinite")) for ax in f.figure.axes
            for image in ax.images]


@needs_matplotlib
def test_every_colour_bar_runs_0_to_100_percent(collapse_log):
    """The fp16 underflow bar ran 0-1 and the inf/NaN bar 0-100, both labelled '% of entries'."""
    images = _heatmap_images(draw_figures(run_data(load_any(str(collapse_log)))))
    assert len(images) == 3   # fp16 underflow, fp16 overflow, inf/NaN
    for image in images:
        assert (image.norm.vmin, image.norm.vmax) == (0.0, 100.0)
        assert image.colorbar.ax.get_ylabel() == "% of entries"
        assert image.colorbar.ax.get_ylim() == pytest.approx((0.0, 100.0))


@pytest.fixture(scope="module")
def bf16_log(tmp_path_factory) -> Path:
    """150 bf16 autocast steps, with the activation look: sampled at steps 0-9, 50 and 100 (every 50)."""
    folder = tmp_path_factory.mktemp("bf16")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 16)
    y = x[:, :1] * 2.0 + 1.0
    with ampdoctor.watch(model, opt, log_dir=str(folder), activations=True):
        for _ in range(150):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return folder / "ampdoctor.jsonl"


@needs_matplotlib
def test_activation_headroom_spans_the_run_and_fits_its_data(bf16_log):
    """The chart covered only the sampled steps, and its bf16 axis ran from 10 down to 1e-39 to reach the data (an
    activation of about 3 over bf16's maximum, 3.4e38) from the overflow line."""
    data = run_data(load_any(str(bf16_log)))
    assert len(data.activations) > 1
    [chart] = [f for f in draw_figures(data) if f.key == "activations"]
    ax = chart.figure.axes[0]
    left, right = ax.get_xlim()
    assert left <= 0 and right >= 149   # the run's steps, not just the sampled ones
    ratios = [a.ratio for a in data.activations if a.ratio]
    assert max(ratios) < 1e-30   # bf16: far below overflow
    low, high = ax.get_ylim()
    assert min(ratios) / 10 <= low <= min(ratios) and max(ratios) <= high <= max(ratios) * 10


@needs_matplotlib
def test_the_heatmaps_mark_where_sampled_steps_jump(bf16_log):
    """The columns are sampled steps, equally spaced but labelled 0, 1, ..., 9, 50, 100: each jump is marked."""
    data = run_data(load_any(str(bf16_log)))
    steps = data.cast_steps
    assert steps[:10] == list(range(10)) and steps[10:] == [50, 100]
    jumps = [col + 0.5 for col in range(len(steps) - 1) if steps[col + 1] - steps[col] > 1]
    [heatmap] = [f for f in draw_figures(data) if f.key == "cast_bf16"]
    for ax in heatmap.figure.axes[:2]:   # the two panels; then their colour bars
        assert sorted(line.get_xdata()[0] for line in ax.lines) == jumps
        assert "steps not sampled" in ax.get_xlabel()
        labels = {int(t): label.get_text() for t, label in zip(ax.get_xticks(), ax.get_xticklabels())}
        assert all(labels[col] == str(steps[col]) for col in labels) and {"50", "100"} <= set(labels.values())


def test_code_spans_are_code_not_backticks(tmp_path):
    """A watch's log without its report says to use `ampdoctor run --log-dir`: the backticks showed as such."""
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampdoctor.watch(model, opt, every=1, log_dir=str(tmp_path)):
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    page = render_html(load_any(str(tmp_path)))
    assert "<code>ampdoctor run --log-dir</code>" in _section(page, "<section id='verdict'", "</section>")
    assert "`" not in _text(page)


def test_code_spans_are_escaped():
    report = Report(findings=[Finding("AMP101", Severity.ERROR, "fc", "a `<script>` span & <b>bold</b>")])
    detail = _section(render_html(Loaded(path="x", report=report)), "<p class='detail'>", "</p>")
    assert detail == "<p class='detail'>a <code>&lt;script&gt;</code> span &amp; &lt;b&gt;bold&lt;/b&gt;"


def test_the_page_counts_findings_as_the_console_lists_them():
    """One .half() makes AMP101 at two modules and AMP104: the console (and `%ampdoctor`) lists 2 findings; the
    inline page said '3 errors, 0 warnings (shown in 2 rows)'."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)).half()
    report = ampdoctor.check(model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu"))
    assert [f.code for f in report.findings] == ["AMP101", "AMP101", "AMP104"]
    out = Console(file=io.StringIO(), width=100, force_terminal=False, color_system=None)
    out.print(render_report(report))
    listed = re.findall(r"^(AMP\d{3}) (error|warning) ", out.file.getvalue(), re.M)
    assert listed == [("AMP101", "error"), ("AMP104", "error")]
    page = render_html(Loaded(path="this notebook", report=report))   # what `%ampdoctor --html` shows
    bar = _section(page, "<section id='verdict'", "</section>")
    assert "<p>2 errors, 0 warnings</p>" in bar and "rows" not in bar


def test_notes_alone_still_say_something():
    """Info findings alone are no error, no warning and no all-clear: the bar said nothing at all."""
    report = Report(findings=[Finding("AMP409", Severity.INFO, "LambdaLR", "scheduler.step() ran after the "
                                      "skipped step 3.", step=3)])
    kind, lines = verdict(Loaded(path="x", report=report), run_data(Loaded(path="x", report=report)))
    assert kind == "partial" and lines == ["1 finding at info severity, none at error or warning"]


def test_the_loss_of_a_log_keeps_its_inf_and_nan(tmp_path):
    """A NaN loss is a point of the series (marked on the plot), not a hole in it."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampdoctor.watch(model, opt, every=1, log_dir=str(tmp_path)):
        for scale in (1.0, float("nan"), 1.0):
            (model(torch.ones(2, 4)).sum() * scale).backward()
            opt.zero_grad()   # no update: the weights stay finite
            opt.step()
    loss = run_data(load_any(str(tmp_path))).loss
    assert [s for s, _ in loss] == [0, 1, 2] and math.isnan(loss[1][1]) and math.isfinite(loss[2][1])
