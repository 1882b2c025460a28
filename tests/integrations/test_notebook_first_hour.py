"""A newcomer's first hour with ``%load_ext ampdoctor``: a crash, the fix, ``%ampdoctor`` and ``--html``, in a real
ipykernel run by nbclient (the helpers of ``test_ipython.py``)."""

from __future__ import annotations

import html
import re

import pytest
from test_ipython import MODEL, finding_rows, run_notebook, scaled_steps, text

# The seed error with Adam: AMP101 on two modules (one row) and AMP104 (Adam's eps=1e-8 is 0 in fp16).
HALF_ADAMW_CRASH = MODEL + """\
model = model.half()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
with torch.autocast("cpu", dtype=torch.float16):
    loss = (model(x.half()).float() - y).pow(2).mean()
scaler.scale(loss).backward()
scaler.step(opt)
"""

# What the explanation says to do: fp32 parameters and a new optimizer over them; the same scaler.
FIXED = "model.float()\nopt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n" + scaled_steps(5)


def page_of(outputs: list[dict]) -> str:
    """The HTML page inside the one inline iframe of ``%ampdoctor --html``, unescaped."""
    (frame,) = [o["data"]["text/html"] for o in outputs
                if o["output_type"] == "display_data" and o["data"].get("text/html", "").startswith("<iframe srcdoc=")]
    return html.unescape(frame)


def page_counts(page: str) -> tuple[int, int]:
    """The errors and warnings the page's verdict counts (0, 0 where it counts none)."""
    verdict = re.search(r"<section id='verdict'.*?</section>", page, re.S)
    assert verdict is not None
    counted = re.search(r"(\d+) errors?, (\d+) warnings?", verdict.group(0))
    return (int(counted.group(1)), int(counted.group(2))) if counted else (0, 0)


def text_counts(shown: str) -> tuple[int, int]:
    """The error and warning rows of the findings tables in ``shown``."""
    lines = shown.splitlines()
    return (sum(bool(re.match(r"AMP\d{3} error\b", line)) for line in lines),
            sum(bool(re.match(r"AMP\d{3} warning\b", line)) for line in lines))


def test_html_magic_shows_the_page_without_an_ipython_warning(tmp_path):
    # IPython's HTML() warns "Consider using IPython.display.IFrame instead" for any <iframe>...</iframe> it is given
    _, _, page = run_notebook("%load_ext ampdoctor", HALF_ADAMW_CRASH, "%ampdoctor --html", tmp_path=tmp_path)
    assert [o for o in page if o["output_type"] == "stream"] == []   # nothing on stderr (or stdout) before the page
    assert "Warning" not in text(page) and "AMP101" in page_of(page)


@pytest.mark.parametrize("magic", ["%ampdoctor", "%ampdoctor --html"])
def test_the_crashed_stage_s_findings_are_an_earlier_stage_once_a_fixed_cell_trains(tmp_path, magic):
    _, crash, fixed, shown = run_notebook("%load_ext ampdoctor", HALF_ADAMW_CRASH, FIXED, magic, tmp_path=tmp_path)
    assert any(o["output_type"] == "error" for o in crash) and "trained True" in text(fixed)
    now, heading, earlier = text(shown).partition("2 findings of an earlier stage (it ended when cell [2] raised)")
    assert heading   # which findings, of which stage
    # what the kernel trains now: the fixed cell's stage, without a finding
    assert text_counts(now) == (0, 0) and "AMP1" not in now
    if magic == "%ampdoctor":
        assert "ampdoctor watch: 5 steps" in now and "no mixed-precision problems found in 5 steps" in now
    else:
        page = page_of(shown)
        assert page_counts(page) == (0, 0) and "AMP101" not in page and "AMP104" not in page
        assert "no mixed-precision problems found in 5 steps" in page
    # the earlier stage's findings stay visible, once each, after the line that says what they are
    assert finding_rows(earlier, "AMP101") == 1 and finding_rows(earlier, "AMP104") == 1
    assert "    encoder" in earlier and "upcast_trainable_params_" in earlier


def test_magic_and_html_count_the_findings_alike(tmp_path):
    # Right after the crash nothing else has trained: its findings are the current ones, in both views.
    _, _, shown, page = run_notebook("%load_ext ampdoctor", HALF_ADAMW_CRASH, "%ampdoctor", "%ampdoctor --html",
                                     tmp_path=tmp_path)
    assert finding_rows(text(shown), "AMP101") == 1 and finding_rows(text(shown), "AMP104") == 1
    assert "earlier stage" not in text(shown) + text(page)
    assert text_counts(text(shown)) == (2, 0)   # AMP101 of two modules is one row, as AMP104 is
    assert page_counts(page_of(page)) == text_counts(text(shown))
