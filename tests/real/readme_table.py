"""Rewrite the "ampdoctor today" and "known gap" columns of ``tests/real/README.md`` from a corpus run.

    AMPDOCTOR_CORPUS_RESULTS=/tmp/corpus.json .venv/bin/python -m pytest -q -rxX tests/real | tee /tmp/real.log
    .venv/bin/python tests/real/readme_table.py /tmp/corpus.json /tmp/real.log

The first file is what ``test_corpus.py`` writes with ``AMPDOCTOR_CORPUS_RESULTS``; the second, pytest's output,
gives the score and runtime lines quoted at the top of the README. The gap column comes from each case's
``known-gap`` and ``known-gap-fix`` header lines, so the README says what the tests expect.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from ampdoctor.core.words import counted

README = Path(__file__).with_name("README.md")


def today(results: dict[str, dict], name: str) -> str:
    """Return what ``ampdoctor run`` reported for case ``name`` (and its ``--fix`` run), in one table cell."""
    run = results[name]
    groups: dict[str, list[dict]] = {}
    for finding in run["findings"]:
        groups.setdefault(finding["code"], []).append(finding)
    parts = []
    for code, found in groups.items():
        severities = "/".join(dict.fromkeys(f["severity"] for f in found))
        parts.append(f"{code}×{len(found)} ({severities})" if len(found) > 1
                     else f"{code} ({severities}; `{found[0]['where']}`)")
    cell = ", ".join(parts) or "no findings"
    fixed = results.get(f"{name} --fix")
    if fixed is not None:
        cell += f"; `--fix`: exit {fixed['exit']}, {counted(fixed['changes'], 'change')}"
    return cell


def gap(name: str) -> str:
    from test_corpus import BY_NAME  # here, not at import: pytest imports this file for its doctests

    case = BY_NAME[name]
    said = [f"**diagnosis:** {case.gap}"] if case.gap else []
    said += [f"**--fix:** {case.fix_gap}"] if case.fix_gap else []
    return " ".join(said) or "—"


def main(argv: list[str]) -> int:
    from test_corpus import BY_NAME

    results = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    log = Path(argv[1]).read_text(encoding="utf-8")
    lines = README.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"\| \[`(\w+)\.py`\]", line)
        if match and match.group(1) in BY_NAME:
            cells = line.split(" | ")
            cells[-2], cells[-1] = today(results, match.group(1)), gap(match.group(1)) + " |"
            lines[i] = " | ".join(cells)
    text = "\n".join(lines) + "\n"
    score = re.search(r"^real-report corpus: .*$", log, re.M)
    runtime = re.search(r"^\d+ ampdoctor runs, .*$", log, re.M)
    if score and runtime:
        text = re.sub(r"^real-report corpus: .*\n\d+ ampdoctor runs, .*$", f"{score.group(0)}\n{runtime.group(0)}",
                      text, count=1, flags=re.M)
    README.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
