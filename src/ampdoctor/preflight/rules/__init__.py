"""Pre-flight rules: pure functions over a `TrainingSetup` that yield findings.

Each check is registered under its catalog code with `@check("AMP101")`, and is handed that catalog `Rule`, which
makes its findings (``rule.finding(where, detail)``): the code is written once. Checks read the real objects; they
never print or mutate. A check is called with the setup alone: ``fp16_trainable_params(setup)``.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Iterator, Sequence

from ampdoctor.core.catalog import Rule, get_rule
from ampdoctor.core.findings import Finding
from ampdoctor.core.names import listing
from ampdoctor.core.training import ParamInfo, TrainingSetup, group_by_module

CheckFn = Callable[[TrainingSetup], Iterable[Finding]]
CHECKS: dict[str, CheckFn] = {}


def check(code: str) -> Callable[[Callable[[TrainingSetup, Rule], Iterable[Finding]]], CheckFn]:
    """Register the decorated ``fn(setup, rule)`` as the pre-flight check of catalog rule ``code``; the registered
    check takes the setup alone."""
    rule = get_rule(code)

    def register(fn: Callable[[TrainingSetup, Rule], Iterable[Finding]]) -> CheckFn:
        if code in CHECKS:
            raise ValueError(f"rule {code} already has a check: {CHECKS[code].__qualname__}")

        @functools.wraps(fn)
        def run(setup: TrainingSetup) -> Iterable[Finding]:
            return fn(setup, rule)

        run.rule = rule  # type: ignore[attr-defined]
        CHECKS[code] = run
        return run

    return register


def findings_by_module(rule: Rule, params: Sequence[ParamInfo], state: str, summary: str) -> Iterator[Finding]:
    """Yield one finding of ``rule`` per owning module naming its ``params``; they share one ``cause``, so they show
    as one row.

    Each detail reads ``name (dtype, shape), ... are {state}. {summary}``; the cause is ``{state}. {summary}``.
    """
    summary = summary[:1].upper() + summary[1:]
    end = " " if state.endswith((".", ".'")) else ". "
    cause = f"{state}{end}{summary}"
    for module, members in group_by_module(params).items():
        verb = "is" if len(members) == 1 else "are"
        yield rule.finding(module, f"{listing([p.describe() for p in members])} {verb} {cause}", cause=cause)
