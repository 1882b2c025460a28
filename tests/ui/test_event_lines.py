"""ampdoctor's event lines start at column 0 while a script's tqdm bar is open, piped into a log as on a terminal.

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
from ampdoctor.ui.plain import Printer

SCRIPT = Path(__file__).parent / "scripts" / "tqdm_loop_train.py"
EVENT = re.compile(r"ampdoctor(\[pid \d+\])?( --fix[^:]*)?:")   # "ampdoctor: ...", "ampdoctor[pid 7] --fix: ..."


def _misplaced(text: str) -> list[str]:
    """Return the lines (as grep splits them, at '\\n') holding an event line that does not start them."""
    return [line for line in text.split("\n") if EVENT.search(line) and not EVENT.match(line)]


@pytest.mark.parametrize("where", ["script", "child"])
def test_fix_lines_start_their_line_in_a_log_while_the_scripts_tqdm_bar_is_open(where):
    # `ampdoctor run --fix` upcasts the fp16 model at its first step, inside the script's tqdm loop; "child" runs
    # the loop in a child Python process, whose lines ampdoctor's child hook prints ("ampdoctor[pid N] --fix: ...").
    env = {**os.environ, "COLUMNS": "80", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--fix", str(SCRIPT),
                           *(["--child"] if where == "child" else [])],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    err = done.stderr
    assert "it/s]" in err   # the bar was drawn, piped
    fixed = [line for line in err.split("\n") if "--fix: upcast trainable parameters" in line]
    assert len(fixed) == 1 and fixed[0].startswith("ampdoctor"), err[-3000:]   # grep '^ampdoctor' finds it
    assert _misplaced(err) == [], err[-3000:]
    lines = err.split("\n")
    after = lines[lines.index(fixed[0]) + 1:]
    # up to the run's closing summary ("ampdoctor changed", with the script's path: where it wraps depends on the
    # path's length, so a change may end on a line of its own there)
    after = after[:after.index("ampdoctor changed")] if "ampdoctor changed" in after else after
    changes = [i for i, line in enumerate(after) if ": upcast torch.float16 -> torch.float32" in line]
    block = after[:changes[3] + 1] if len(changes) == 4 else after
    # the wrapped rest of the line and the 4 changes follow, with no bar or blank line between them
    assert len(changes) == 4 and all(line.strip() and "it/s" not in line for line in block), block


def test_a_line_said_while_a_bar_is_open_in_a_log_ends_the_bars_line_once():
    out = io.StringIO()
    say = Printer(out=Console(file=out, width=80, highlight=False))   # every entry point prints through one
    bar = tqdm(range(10), file=out, mininterval=0, ascii=True)
    for i in bar:
        if i == 3:
            say("ampdoctor --fix: upcast trainable parameters to float32; 4 changes")
            say("  0.weight: upcast torch.float16 -> torch.float32")
    bar.close()
    lines = out.getvalue().split("\n")
    said = lines.index("ampdoctor --fix: upcast trainable parameters to float32; 4 changes")
    assert lines[said + 1] == "  0.weight: upcast torch.float16 -> torch.float32"
    assert "3/10" in lines[said - 1]   # the bar's line, ended
    assert "10/10" in lines[-2]   # the bar goes on below
    assert _misplaced(out.getvalue()) == []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_bar_is_cleared_and_redrawn_under_the_line():
    out = _Terminal()
    bar = tqdm(total=5, file=out, mininterval=0, ascii=True)
    bar.update(2)
    with clear_of_bars(out):
        out.write("ampdoctor: a line\n")
    text = out.getvalue()
    assert "\rampdoctor: a line\n" in text   # after tqdm's clear: column 0 on a terminal
    assert "2/5" in text.split("ampdoctor: a line\n")[1]   # redrawn under it
    bar.close()


def test_clear_of_bars_does_nothing_without_an_open_bar_on_that_stream():
    out = io.StringIO()
    tqdm(range(3), file=out).close()   # closed: the bar's line is ended
    before = out.getvalue()
    with clear_of_bars(out):
        out.write("ampdoctor: a line\n")
    assert out.getvalue() == before + "ampdoctor: a line\n"
    disabled = tqdm(range(3), file=out, disable=True)   # a disabled bar draws nothing: nothing to clear
    elsewhere = tqdm(total=3, file=io.StringIO(), mininterval=0)   # a bar on another stream
    elsewhere.update(1)
    with clear_of_bars(out):
        out.write("ampdoctor: another\n")
    disabled.close()
    elsewhere.close()
    assert out.getvalue() == before + "ampdoctor: a line\nampdoctor: another\n"


def test_a_bar_that_cannot_be_cleared_does_not_stop_the_line():
    out = _Terminal()
    bar = tqdm(total=5, file=out, mininterval=0)
    bar.update(1)
    out.close()   # the bar's stream is gone: tqdm's clear raises; the line is still written
    with clear_of_bars(out):
        pass
    bar.disable = True   # closing would write to the closed stream


def test_a_line_said_into_a_log_left_mid_line_without_tqdm_starts_its_own_line(tmp_path):
    # another progress display ("step 3/10\r" with no newline), stderr redirected to a file: `> log 2>&1`
    log = tmp_path / "train.log"
    with open(log, "w") as stream:
        stream.write("step 3/10 loss 0.52")
        say = Printer(out=Console(file=stream, width=80, highlight=False))
        say("ampdoctor --fix: upcast trainable parameters to float32; 4 changes")
        say("  0.weight: upcast torch.float16 -> torch.float32")   # at a line start: no blank line
    assert log.read_text().split("\n") == ["step 3/10 loss 0.52",
                                           "ampdoctor --fix: upcast trainable parameters to float32; 4 changes",
                                           "  0.weight: upcast torch.float16 -> torch.float32", ""]
