"""ampdoctor's lines start at column 0 while a script's tqdm bar is open, piped into a log file as on a terminal.

A tqdm bar redraws its line with '\\r' and ends it only when it closes, so a line written while it is open used to
continue the bar's line (``...it/s]ampdoctor --fix: ...``), and ``grep '^ampdoctor'`` missed it.
"""

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from tqdm import tqdm

from ampdoctor._compat.tqdm import clear_of_bars
from ampdoctor.ui.cli import _say

SCRIPT = Path(__file__).parent / "scripts" / "tqdm_loop_train.py"


def _pieces(text: str) -> list[str]:
    """Return what a terminal or a log reader shows as line starts: the text split at every '\\n' and '\\r'."""
    return re.split(r"[\r\n]", text)


def _misplaced(text: str) -> list[str]:
    return [piece for piece in _pieces(text) if "ampdoctor" in piece and not piece.startswith("ampdoctor")]


@pytest.mark.parametrize("where", ["script", "child"])
def test_fix_lines_start_at_column_0_while_the_scripts_tqdm_bar_is_open(where):
    # `ampdoctor run --fix` upcasts the fp16 model at its first step, inside the script's tqdm loop; "child" runs
    # the loop in a child Python process, whose lines ampdoctor's child hook prints ("ampdoctor[pid N] ...").
    env = {**os.environ, "COLUMNS": "80", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--fix", "--no-children"[:0] or "--fix", str(SCRIPT),
                           *(["--child"] if where == "child" else [])],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    err = done.stderr
    assert "it/s]" in err   # the bar was drawn, piped
    fix_lines = [piece for piece in _pieces(err) if "--fix: upcast trainable parameters" in piece]
    assert fix_lines, err[-3000:]
    assert _misplaced(err) == [], err[-3000:]
    assert any(line.startswith("ampdoctor") for line in err.split("\n") if "--fix: upcast" in line)  # grep '^amp'


def test_a_line_said_while_a_bar_is_open_on_the_same_stream_starts_at_column_0():
    out = io.StringIO()
    console = Console(file=out, width=80, highlight=False)
    bar = tqdm(range(10), file=out, mininterval=0, ascii=True)
    for i in bar:
        if i == 3:
            _say(console, "ampdoctor --fix: upcast trainable parameters to float32; 4 change(s)")
    bar.close()
    text = out.getvalue()
    assert "ampdoctor --fix: upcast trainable parameters to float32; 4 change(s)" in _pieces(text)
    assert _misplaced(text) == []
    assert text.rstrip().endswith("10/10 [00:00<00:00, ?it/s]") or "10/10" in _pieces(text.rstrip())[-1]


def test_clear_of_bars_does_nothing_without_an_open_bar():
    out = io.StringIO()
    tqdm(range(3), file=out).close()   # closed: the bar's line is ended
    before = out.getvalue()
    with clear_of_bars(out):
        out.write("ampdoctor: a line\n")
    assert out.getvalue() == before + "ampdoctor: a line\n"
    disabled = tqdm(range(3), file=out, disable=True)   # a disabled bar draws nothing: nothing to clear
    with clear_of_bars(out):
        out.write("ampdoctor: another\n")
    disabled.close()
    assert out.getvalue() == before + "ampdoctor: a line\nampdoctor: another\n"


def test_a_bar_that_cannot_be_cleared_does_not_stop_the_line():
    out = io.StringIO()
    bar = tqdm(total=5, file=out, mininterval=0)
    bar.update(1)
    out.close()   # the bar's stream is gone: tqdm's clear raises; the line still goes to the other stream
    other = io.StringIO()
    with clear_of_bars(other):
        other.write("ampdoctor: still said\n")
    assert other.getvalue().endswith("ampdoctor: still said\n")
    bar.disable = True   # closing would write to the closed stream
