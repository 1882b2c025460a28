"""Do no harm, durability: a run killed with SIGKILL mid-training leaves a flight recorder that reads back, and that
`ampdoctor report` renders, up to the last sampled step that was written whole. A torn last line is tolerated and
named.

One real training process is started under `python -m ampdoctor run --every 1 --log-dir DIR` and killed; the
other tests cut that log (or one written in-process) at every byte of its last line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ampdoctor
from ampdoctor.core.records import LOG_NAME, SCHEMA, read_log
from ampdoctor.ui.cli import main

from .test_identity import load_script, one_torch_thread, script_path  # noqa: F401  (autouse fixture)

STEPS_BEFORE_KILL = 5
START_TIMEOUT_S = 120  # the child imports torch first: seconds on a busy 2-core machine


def _step_lines(path: Path) -> int:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    return sum(1 for line in data.split(b"\n")[:-1] if b'"type":"step"' in line)


@pytest.fixture(scope="module")
def killed_log(tmp_path_factory) -> Path:
    """Start the endless script under `ampdoctor run`, wait for STEPS_BEFORE_KILL step lines, SIGKILL it."""
    log_dir = tmp_path_factory.mktemp("killed")
    log = log_dir / LOG_NAME
    src = Path(ampdoctor.__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]))
    stderr = (log_dir / "stderr.txt").open("wb")  # a file, not a pipe: a full pipe would stall the child
    proc = subprocess.Popen([sys.executable, "-m", "ampdoctor", "run", "--every", "1", "--log-dir", str(log_dir),
                             script_path("endless.py"), "120"],
                            stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while _step_lines(log) < STEPS_BEFORE_KILL:
            if proc.poll() is not None:
                pytest.fail(f"the training process exited ({proc.returncode}) before it was killed:\n"
                            f"{(log_dir / 'stderr.txt').read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {STEPS_BEFORE_KILL} step lines in {log} after {START_TIMEOUT_S} s")
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        stderr.close()
    return log


def test_a_killed_run_leaves_a_readable_log_up_to_its_last_written_step(killed_log):
    header, records, problems = read_log(killed_log)
    assert header is not None and header["schema"] == SCHEMA
    steps = [r["step"] for r in records if r.get("type") == "step"]
    assert len(steps) >= STEPS_BEFORE_KILL
    assert steps == list(range(len(steps)))  # every sampled step, in order, none lost before the last
    assert not [r for r in records if r.get("type") == "end"]  # killed: no clean close
    # at most the line being written when the kill came is lost, and then it is named
    assert all("torn last line" in p or "no newline" in p for p in problems), problems
    last = records[-1]
    assert last["type"] == "step" and "gradients" in last and "scale" in last


def _render(path: Path, *extra: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", str(path), *extra])
    return code, out.getvalue() + err.getvalue()


def test_ampdoctor_report_renders_a_killed_run(killed_log, tmp_path):
    code, text = _render(killed_log, "--html", str(tmp_path / "report.html"))
    assert code in (0, 1), text
    assert "Traceback" not in text
    assert (tmp_path / "report.html").read_text(encoding="utf-8").lstrip().lower().startswith("<!doctype html")


def _cut_points(log: Path) -> tuple[bytes, list[int]]:
    """The log's bytes and every offset inside its last line (just after the previous newline, up to the end)."""
    data = log.read_bytes()
    if not data.endswith(b"\n"):  # the kill left a torn line already: drop it to start from a whole log
        data = data[: data.rindex(b"\n") + 1]
    start = data.rindex(b"\n", 0, len(data) - 1) + 1
    return data, list(range(start + 1, len(data) - 1))


def test_a_torn_last_line_is_tolerated_and_named(killed_log, tmp_path):
    data, cuts = _cut_points(killed_log)
    _, whole, _ = read_log(killed_log)
    whole_steps = [r["step"] for r in whole if r.get("type") == "step"]
    torn = tmp_path / "torn.jsonl"
    for cut in cuts:  # every byte of the last line
        torn.write_bytes(data[:cut])
        header, records, problems = read_log(torn)
        assert header is not None
        steps = [r["step"] for r in records if r.get("type") == "step"]
        assert steps == whole_steps[: len(steps)] and len(steps) >= len(whole_steps) - 1
        line_number = data[:cut].count(b"\n") + 1
        assert len(problems) == 1 and f"line {line_number}:" in problems[0], (cut, problems)
        assert "torn" in problems[0] or "no newline" in problems[0]


def test_a_log_cut_after_its_newline_has_no_problem(killed_log, tmp_path):
    data, _ = _cut_points(killed_log)
    whole = tmp_path / "whole.jsonl"
    whole.write_bytes(data)
    header, records, problems = read_log(whole)
    assert header is not None and problems == [] and records


def test_ampdoctor_report_renders_a_torn_log_and_names_the_torn_line(killed_log, tmp_path):
    data, cuts = _cut_points(killed_log)
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(data[: cuts[len(cuts) // 2]])
    code, text = _render(torn)
    assert code in (0, 1) and "Traceback" not in text
    assert "torn" in text.lower()


def test_a_run_killed_before_its_header_is_a_clear_error(tmp_path):
    log = tmp_path / "empty.jsonl"
    log.write_bytes(b"")
    header, records, problems = read_log(log)
    assert (header, records) == (None, []) and problems == ["empty file: no header line"]
    code, text = _render(log)
    assert code in (1, 2) and "Traceback" not in text  # an empty file is no log: a usage error is fine


def _early_log(killed: str, killed_log: Path, tmp_path: Path) -> Path:
    header_line = killed_log.read_bytes().split(b"\n", 1)[0]
    log = tmp_path / "early.jsonl"
    log.write_bytes(header_line[: len(header_line) // 2] if killed == "inside-the-header" else header_line + b"\n")
    return log


@pytest.mark.parametrize("killed", ["inside-the-header", "after-the-header"])
def test_a_run_killed_before_its_first_step_reads_back(killed, killed_log, tmp_path):
    header, records, problems = read_log(_early_log(killed, killed_log, tmp_path))
    assert records == []
    if killed == "after-the-header":
        assert header is not None and problems == []
    else:
        assert header is None and len(problems) == 1 and "torn last line" in problems[0]


@pytest.mark.parametrize("killed", [
    "inside-the-header", "after-the-header"])
def test_ampdoctor_report_renders_a_run_killed_before_its_first_step(killed, killed_log, tmp_path):
    code, text = _render(_early_log(killed, killed_log, tmp_path))
    assert code in (0, 1) and "Traceback" not in text, text


def test_every_step_line_is_on_disk_when_the_step_returns(tmp_path):
    """In-process, without a kill: after each ``scaler.update()`` returns, the file as the OS has it (what SIGKILL
    would leave) holds every step so far, whole."""
    train = load_script("amp_loop.py")["train"]
    snapshots: list[bytes] = []

    @contextlib.contextmanager
    def attach(model, opt, scaler):
        with ampdoctor.watch(model, opt, scaler, every=1, log_dir=str(tmp_path / "live")) as w:
            observed = scaler.update  # the watch's observer

            def update_then_snapshot(*args, **kwargs):
                result = observed(*args, **kwargs)
                snapshots.append(Path(w.log_path).read_bytes())
                return result

            scaler.update = update_then_snapshot
            try:
                yield w
            finally:
                scaler.update = observed  # put the watch's observer back before it detaches

    train("foreach", steps=6, attach=attach)
    assert len(snapshots) == 6
    for n, data in enumerate(snapshots):
        snap = tmp_path / f"snap{n}.jsonl"
        snap.write_bytes(data)
        header, records, problems = read_log(snap)
        assert header is not None and problems == []
        assert [r["step"] for r in records] == list(range(n + 1))


def test_every_line_of_a_killed_log_is_a_json_object(killed_log):
    """Non-finite values are NaN/Infinity tokens, which json.loads reads; nothing else is special."""
    lines = killed_log.read_bytes().split(b"\n")
    for line in lines[:-1]:
        assert isinstance(json.loads(line), dict)
