"""Score of the real-report corpus, printed at the end of the pytest run.

A test counts only if its assertions held: xfail (a known gap), failures and errors all count as not passing.
"""

from __future__ import annotations

from typing import Any

import pytest

CATEGORIES = ("diagnosed", "quiet", "repaired")
_outcomes: dict[str, dict[str, bool]] = {c: {} for c in CATEGORIES}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "corpus(category): a real-report corpus case (diagnosed, quiet, repaired)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("corpus")
    if marker is None or not marker.args:
        return
    category = marker.args[0]
    if report.when == "call" or (report.when == "setup" and not report.passed):
        passed = report.passed and not hasattr(report, "wasxfail")
        _outcomes[category][item.nodeid] = passed


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not any(_outcomes.values()):
        return
    parts = [f"{category} {sum(done.values())}/{len(done)}" for category, done in _outcomes.items() if done]
    terminalreporter.write_sep("=", "real-report corpus")
    terminalreporter.write_line(f"real-report corpus: {', '.join(parts)}")
    stats = getattr(terminalreporter.config, "real_corpus_stats", None)
    if stats:
        terminalreporter.write_line(
            f"{stats['runs']} ampdoctor runs, {stats['workers']} at a time: {stats['wall_s']:.0f} s wall, "
            f"{stats['cpu_s']:.0f} s CPU in the subprocesses (~{stats['cpu_s'] / max(stats['workers'], 1):.0f} s "
            f"wall on {stats['workers']} idle cores)")
    failing = [nodeid.split("::")[-1] for done in _outcomes.values() for nodeid, ok in done.items() if not ok]
    if failing:
        terminalreporter.write_line(f"not passing ({len(failing)}): {' '.join(failing)}")
