"""What the README and the hand-written docs pages show a command print is what it prints today.

A shown output is a ``text`` block whose first line is ``$ COMMAND``: the test runs COMMAND from the repository's
root as the reader would (80 columns; ``docs/rules/examples/record.py`` runs it and takes the machine's paths out)
and checks that every shown line is a line of the output, in order. A line ``...`` stands for lines left out.
A number with a decimal point may differ from the shown one by 1e-3 of it (``SAME_NUMBER``): a training's losses
differ in their last digits between CPUs whose kernels round differently (an AVX-512 machine printed ``loss
1.0688`` where the page, recorded on another, shows ``1.0687``); words, integers and the layout must be the same.
The rule pages' examples are checked whole by test_rule_pages.py.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK = re.compile(r"^```text\n\$ (?P<command>[^\n]+)\n(?P<shown>.*?)^```", re.S | re.M)

_spec = importlib.util.spec_from_file_location("record", ROOT / "docs" / "rules" / "examples" / "record.py")
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)


def shown_outputs() -> list[tuple[str, str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            line = text[:match.start()].count("\n") + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match["command"], match["shown"]))
    return found


SAME_NUMBER = 1e-3   # relative
DECIMAL = re.compile(r"[-+]?\d*\.\d+(?:e[-+]?\d+)?")


def same_line(want: str, got: str) -> bool:
    """Whether output line ``got`` is shown line ``want``: equal, or equal but for decimals within ``SAME_NUMBER``
    (the columns of a table move with a number's width)."""
    if want == got:
        return True
    if " ".join(DECIMAL.sub("#", want).split()) != " ".join(DECIMAL.sub("#", got).split()):
        return False
    return all(math.isclose(float(a), float(b), rel_tol=SAME_NUMBER)
               for a, b in zip(DECIMAL.findall(want), DECIMAL.findall(got)))


def missing(shown: str, output: str) -> list[str]:
    """The shown lines that are not lines of ``output`` in the order shown (``...`` skips any lines)."""
    lines = [line.rstrip() for line in output.splitlines()]
    at, gone = 0, []
    for want in (line.rstrip() for line in shown.splitlines()):
        if want.strip() in ("...", ""):
            continue
        found = next((k for k in range(at, len(lines)) if same_line(want, lines[k])), None)
        if found is None:
            gone.append(want)
        else:
            at = found + 1
    return gone


def test_the_pages_show_outputs_to_check():
    assert len(shown_outputs()) >= 3   # the README's demo, attach and --fix outputs at least


def test_missing_finds_a_changed_line_and_accepts_a_cut():
    output = "a\nb\nc\nd\n"
    assert missing("a\n...\nd\n", output) == []
    assert missing("a\nc\nb\n", output) == ["b"]   # out of order
    assert missing("a\nB\n", output) == ["B"]


def test_a_shown_decimal_may_differ_in_its_last_digits_and_nothing_else_may():
    output = "step 1  loss 1.0688\nmodule   L2\nhead  0.03651\n"
    assert missing("step 1  loss 1.0687\n", output) == []   # another CPU's rounding
    assert missing("head 0.0365\n", output) == []           # a table's column moves with the width
    assert missing("step 2  loss 1.0688\n", output) == ["step 2  loss 1.0688"]   # integers are exact
    assert missing("step 1  loss 1.0900\n", output) == ["step 1  loss 1.0900"]   # 2e-2 off: another result
    assert missing("step 1  loss 1.0688 (nan)\n", output) == ["step 1  loss 1.0688 (nan)"]


@pytest.mark.slow
@pytest.mark.parametrize("where,command,shown", shown_outputs(), ids=[w for w, _, _ in shown_outputs()])
def test_a_shown_output_is_what_the_command_prints(where, command, shown):
    output = record.run_command(command.split("  #")[0].strip(), ROOT)
    assert missing(shown, output) == [], f"{where}: `{command}` no longer prints these lines; it prints:\n{output}"
