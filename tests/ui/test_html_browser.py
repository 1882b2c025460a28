"""The HTML report rendered by a real headless browser: the plots have a size, the findings table is on the page.

The page itself has no JavaScript. To measure the layout, the test renders a copy with a measuring script appended
and reads the result back from ``--dump-dom``; a screenshot of the page as it is checks that it paints. Skips,
naming what is missing, only where no Chromium is found (.ci/run installs Debian's ``chromium``).
Set ``AMPDOCTOR_REPORT_SCREENSHOT=path.png`` to keep the screenshot.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ampdoctor.ui.figures import have_matplotlib
from ampdoctor.ui.report_files import load_any, write_html

BROWSERS = ("chromium", "chromium-headless-shell", "chromium-browser", "google-chrome", "google-chrome-stable",
            "headless_shell")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "short_overflow.py"
MEASURE = """<script>
const box = e => { const b = e.getBoundingClientRect(); return [Math.round(b.width), Math.round(b.height)]; };
const table = document.getElementById('findings');
const out = {figures: [...document.querySelectorAll('figure')].map(f => {
               const g = f.querySelector('svg, img'); return [f.id, ...(g ? box(g) : [0, 0])]; }),
             findings: table ? [table.querySelectorAll('tbody tr').length, ...box(table)] : null,
             verdict: document.getElementById('verdict').innerText,
             height: document.documentElement.scrollHeight};
const pre = document.createElement('pre'); pre.id = 'measured'; pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def _browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip(f"no headless browser on PATH (looked for {', '.join(BROWSERS)}); "
                "install one with `apt-get install chromium`")


def _chromium(browser: str, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={tmp / 'profile'}", "--window-size=1200,3000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def _measure(browser: str, page: Path, tmp: Path) -> dict:
    probe = tmp / f"measure-{page.name}"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    done = _chromium(browser, tmp, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri())
    found = re.search(r'<pre id="measured">(.*?)</pre>', done.stdout, re.S)
    assert found, f"no measurement in the rendered DOM; browser said: {done.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


@pytest.fixture(scope="module")
def overflow_log(tmp_path_factory) -> Path:
    """A real `ampdoctor run --log-dir D --activations` of a script whose FFN output overflows fp16."""
    folder = tmp_path_factory.mktemp("run")
    done = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--log-dir", str(folder), "--activations",
                           str(SCRIPT)], capture_output=True, text=True, timeout=300)
    log = folder / "ampdoctor.jsonl"
    assert log.is_file() and b'"type":"report"' in log.read_bytes(), done.stdout[-2000:] + done.stderr[-2000:]
    return log


def test_report_page_renders_with_plots_and_findings(overflow_log, tmp_path):
    browser = _browser()
    page = tmp_path / "report.html"
    write_html(load_any(str(overflow_log)), str(page))
    shot = tmp_path / "report.png"
    done = _chromium(browser, tmp_path, f"--screenshot={shot}", page.as_uri())
    assert shot.is_file() and shot.stat().st_size > 20_000, done.stderr[-2000:]  # painted, not a blank page
    if os.environ.get("AMPDOCTOR_REPORT_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["AMPDOCTOR_REPORT_SCREENSHOT"])
    measured = _measure(browser, page, tmp_path)
    rows, width, height = measured["findings"]
    assert rows == 3 and width > 400 and height > 100  # AMP603, AMP601, AMP604: one row each
    # the verdict names what went wrong and where, as the findings table's first rows do
    assert "AMP603 The loss scale keeps falling: GradScaler" in measured["verdict"], measured["verdict"]
    assert "AMP601 A module produced inf/NaN in the forward pass: 1.wo (Linear)" in measured["verdict"]
    figures = {name: (w, h) for name, w, h in measured["figures"]}
    if have_matplotlib():
        assert {"fig-loss_scale", "fig-activations", "fig-cast_fp16"} <= set(figures)
        assert all(w > 300 and h > 100 for w, h in figures.values()), figures
    else:
        assert not figures
    assert measured["height"] < 9000  # a short page


def test_page_of_a_log_cut_mid_line_renders(overflow_log, tmp_path):
    browser = _browser()
    data = overflow_log.read_bytes()
    torn = tmp_path / "ampdoctor.jsonl"
    torn.write_bytes(data[:data.rindex(b'{"type":"step"') + 200])  # killed while writing a step line
    page = tmp_path / "torn.html"
    write_html(load_any(str(torn)), str(page))
    measured = _measure(browser, page, tmp_path)
    assert "without its end line" in measured["verdict"], measured["verdict"]
    assert "saw inf/NaN first in the output of 1.wo at step 0" in measured["verdict"], measured["verdict"]
    figures = {name: (w, h) for name, w, h in measured["figures"]}
    if have_matplotlib():
        assert "fig-loss_scale" in figures and all(w > 300 and h > 100 for w, h in figures.values()), figures
