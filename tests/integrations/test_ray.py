"""``ampdoctor.attach()`` in Ray Train's workers: a real ``TorchTrainer`` with two CPU workers on gloo.

One run of ``scripts/ray_train_seed.py`` (one local Ray session for all the tests, whose start-up is most of its
60-90 s) trains the seed error, then correct AMP, each fit with two workers, the loop inside
``with ampdoctor.attach(...)``; then correct AMP again under a bare ``ampdoctor.attach(...)``. Ray gives
each worker's lines on the driver's output, prefixed with ``(RayTrainWorker pid=N)``; each worker names its run and
rank first, so the tests read what each rank printed. Rank 0 prints the job's one report, as under torchrun.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
from launch_jobs import clean_environment, run_job

from ampdoctor.runner.attached import RAY_WORKER_LINE

pytest.importorskip("ray.train.torch")

SCRIPT = Path(__file__).parent / "scripts" / "ray_train_seed.py"
SRC = str(Path(__file__).resolve().parents[2] / "src")
RUNS = ("seed", "amp", "amp:bare")
TIMEOUT = 400   # Ray's start-up and three fits take 60-90 s on two cores; a hang must fail, not stall the suite
WORKER_LINE = re.compile(r"^\(RayTrainWorker pid=(\d+)\) ?(.*)$")


class RayJob:
    """The script's exit status, its output, and each worker's lines by (run, rank)."""

    def __init__(self, folder: Path, code: int, output: str) -> None:
        self.folder, self.code, self.output = folder, code, output
        by_pid: dict[str, list[str]] = defaultdict(list)
        for line in output.splitlines():
            match = WORKER_LINE.match(line)
            if match:
                by_pid[match[1]].append(match[2])
        self.lines: dict[tuple[str, int], list[str]] = {}
        for lines in by_pid.values():
            named = next((m for m in map(re.compile(r"ray_train_seed: (\S+) rank (\d)$").match, lines) if m), None)
            if named:
                self.lines[named[1], int(named[2])] = lines

    def text(self, run: str, rank: int) -> str:
        return "\n".join(self.lines.get((run, rank), []))

    def report(self, run: str) -> dict:
        return json.loads((self.folder / run / "report.json").read_text())


@pytest.fixture(scope="module")
def ray_job(tmp_path_factory) -> RayJob:
    folder = tmp_path_factory.mktemp("ray")
    env = clean_environment(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=SRC, RAY_ADDRESS="local",
                            RAY_DEDUP_LOGS="0", RAY_COLOR_PREFIX="0", RAY_USAGE_STATS_ENABLED="0")
    code, output = run_job([sys.executable, str(SCRIPT), str(folder), *RUNS], folder, env, TIMEOUT, merge_stderr=True)
    return RayJob(folder, code, output)


def test_the_seed_error_on_both_workers_is_one_report_from_rank_0_naming_the_modules_and_ranks(ray_job):
    output, zero, one = ray_job.output, ray_job.text("seed", 0), ray_job.text("seed", 1)
    assert ray_job.code == 1 and "ray_train_seed: seed failed: " in output, output[-5000:]   # fit() raised
    assert zero and one, output[-5000:]
    assert "AMP101 error 2 modules: Trainable float16 parameters under an fp16 GradScaler\n    fc1\n    head\n" \
           "    on ranks 0, 1\n" in zero, zero
    assert "ValueError: Attempting to unscale FP16 gradients." in zero
    assert "ampdoctor: ranks 0, 1 failed with ValueError: Attempting to unscale FP16" in zero   # one line, both
    assert "scaler.step(opt)" in one and "ampdoctor/core/patch.py" not in output   # Ray's traceback: the user's
    assert output.count("ampdoctor findings") == 1   # rank 0 alone, once: the job's report
    assert "AMP101" not in one and "ampdoctor: rank 1's failure is in rank 0's report" in one, one
    report = ray_job.report("seed")
    assert report["ranks"]["reported"] == [0, 1] and report["ranks"]["missing"] == []
    assert ("AMP101", [0, 1]) in [(f["code"], f.get("ranks")) for f in report["findings"]]
    assert report["exception"]["type"] == "ValueError"
    assert sorted(p.name for p in (ray_job.folder / "seed" / "logs").iterdir()) == [
        "ampdoctor.rank0.jsonl", "ampdoctor.rank1.jsonl"]
    assert not list(Path(tempfile.gettempdir()).glob("ampdoctor-*-ranks-*-attach*"))   # the exchange is cleared


def test_correct_amp_trains_on_both_workers_and_is_reported_healthy(ray_job):
    output, zero = ray_job.output, ray_job.text("amp", 0)
    assert "ray_train_seed: amp ok" in output, output[-5000:]
    assert "ampdoctor: no mixed-precision problems found in 4 steps" in zero, zero
    assert "AMP" not in zero + ray_job.text("amp", 1)
    report = ray_job.report("amp")
    assert report["ok"] is True and report["findings"] == [] and report["exception"] is None
    assert report["ranks"]["reported"] == [0, 1] and report["watch"]["steps"] == 4


def test_a_bare_attach_in_a_worker_says_once_that_ray_kills_it_before_its_report(ray_job):
    output, zero, one = ray_job.output, ray_job.text("amp-bare", 0), ray_job.text("amp-bare", 1)
    assert "ray_train_seed: amp-bare ok" in output, output[-5000:]
    assert RAY_WORKER_LINE in zero.splitlines() and len(RAY_WORKER_LINE) <= 80, zero
    assert output.count(RAY_WORKER_LINE) == 1 and RAY_WORKER_LINE not in one   # rank 0, once; not in a with block
    # what it warns of: Ray kills the worker after the fit, so the report due at exit never comes
    assert "no mixed-precision problems found" not in zero
    assert not (ray_job.folder / "amp-bare" / "report.json").exists()
    exchange = list((ray_job.folder / "amp-bare" / "exchange").iterdir())   # the ranks' hand-over is left behind
    assert sorted(p.name for p in exchange[0].iterdir()) == ["started0", "started1"], exchange
