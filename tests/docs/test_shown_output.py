"""What the README and the hand-written docs pages show a command print is what it prints today.

A shown output is a ``text`` block whose first line is ``$ COMMAND``: the test runs COMMAND from the repository's
root as the reader would (80 columns; ``docs/rules/examples/record.py`` runs it and takes the machine's paths out)
and checks that every shown line is a line of the output, in order. A line ``...`` stands for lines left out.
The rule pages' examples are checked whole by test_rule_pages.py.
"""

from __future__ import annotations

import importlib.util
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


def missing(shown: str, output: str) -> list[str]:
    """The shown lines that are not lines of ``output`` in the order shown (``...`` skips any lines)."""
    lines = [line.rstrip() for line in output.splitlines()]
    at, gone = 0, []
    for want in (line.rstrip() for line in shown.splitlines()):
        if want.strip() in ("...", ""):
            continue
        try:
            at = lines.index(want, at) + 1
        except ValueError:
            gone.append(want)
    return gone


def test_the_pages_show_outputs_to_check():
    assert len(shown_outputs()) >= 3   # the README's demo, attach and --fix outputs at least


def test_missing_finds_a_changed_line_and_accepts_a_cut():
    output = "a\nb\nc\nd\n"
    assert missing("a\n...\nd\n", output) == []
    assert missing("a\nc\nb\n", output) == ["b"]   # out of order
    assert missing("a\nB\n", output) == ["B"]


@pytest.mark.slow
@pytest.mark.parametrize("where,command,shown", shown_outputs(), ids=[w for w, _, _ in shown_outputs()])
def test_a_shown_output_is_what_the_command_prints(where, command, shown):
    output = record.run_command(command.split("  #")[0].strip(), ROOT)
    assert missing(shown, output) == [], f"{where}: `{command}` no longer prints these lines; it prints:\n{output}"
