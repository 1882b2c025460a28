"""The JSON-lines flight recorder: flushed lines, torn and garbage lines, and a training process killed mid-run."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ampdoctor.core.records import LOG_NAME, SCHEMA, FlightRecorder, read_log
from ampdoctor.monitor.watcher import watch


def test_each_sampled_step_is_on_disk_before_the_next_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with watch(model, opt, every=2, log_dir=str(tmp_path), dense=0) as w:
        for _ in range(6):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            seen.append(len(read_log(tmp_path)[1]))  # read by another file handle while training
    assert seen == [1, 1, 2, 2, 3, 3]
    header, records, problems = read_log(tmp_path / LOG_NAME)
    assert problems == []
    assert header["schema"] == SCHEMA and [p["name"] for p in header["params"]] == ["weight", "bias"]
    assert [r["step"] for r in records if r["type"] == "step"] == [0, 2, 4]
    assert records[-1]["type"] == "end" and records[-1]["steps"] == 6
    assert w.log_path == str(tmp_path / LOG_NAME)


def test_torn_last_line_and_garbage_are_reported_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    with FlightRecorder(path, {"params": []}) as rec:
        rec.write({"type": "step", "step": 0, "norm": math.inf, "bad": math.nan})
        rec.write({"type": "step", "step": 1})
    with open(path, "ab") as f:
        f.write(b"this is not json\n[1, 2]\n\xff\xfe\n")
        f.write(b'{"type": "step", "step": 2, "grad')  # the process died mid-write
    header, records, problems = read_log(path)
    assert header is not None and header["params"] == []
    assert [r["step"] for r in records] == [0, 1]
    assert (records[0]["norm"], records[0]["bad"]) == ("inf", "nan")   # strict JSON; the typed views read floats
    assert len(problems) == 4
    assert problems[0].startswith("line 4: not JSON")
    assert problems[1].startswith("line 5: a JSON list, not an object")
    assert problems[2].startswith("line 6: not JSON")
    assert problems[3].startswith("line 7: torn last line")


def test_a_complete_last_line_without_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text('{"type": "header", "schema": "ampdoctor.watch/1"}\n{"type": "step", "step": 0}')
    header, records, problems = read_log(path)
    assert records == [{"type": "step", "step": 0}]
    assert problems == ["line 2: no newline at the end; the record is complete and kept"]


def test_missing_or_foreign_header_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text('{"type": "step", "step": 0}\n')
    assert read_log(path) == (None, [{"type": "step", "step": 0}],
                              ["line 1: the file does not start with a header line"])
    path.write_text('{"type": "header", "schema": "other/9"}\n')
    assert read_log(path)[2] == ["line 1: header schema 'other/9', expected 'ampdoctor.watch/2' (or an older "
                                 "'ampdoctor.watch/1')"]
    path.write_text("")
    assert read_log(path) == (None, [], ["empty file: no header line"])


def test_writing_after_close_raises(tmp_path: Path) -> None:
    rec = FlightRecorder(tmp_path, {})
    rec.close()
    rec.close()
    with pytest.raises(ValueError, match="is closed"):
        rec.write({"type": "step"})


SCRIPT = """
import sys, time, torch
from torch import nn
import ampdoctor
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
w = ampdoctor.watch(model, opt, scaler, every=1, log_dir=sys.argv[1])
step = 0
while True:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt); scaler.update(); opt.zero_grad()
    step += 1
    time.sleep(0.01)
"""


def test_sigkill_mid_training_leaves_a_readable_log(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log = tmp_path / "log" / LOG_NAME
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if log.exists() and log.read_bytes().count(b"\n") >= 8:
                break
            if proc.poll() is not None:
                pytest.fail(f"training script exited early: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        else:
            pytest.fail("the training script wrote fewer than 8 lines in 120 s")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    header, records, problems = read_log(log)
    assert header is not None and header["every"] == 1
    steps = [r["step"] for r in records]
    assert len(steps) >= 7 and steps == list(range(len(steps)))  # every completed sampled step, in order
    assert all(r["type"] == "step" for r in records)  # no end line: it never closed
    assert all(p.startswith(f"line {len(records) + 2}: torn last line") for p in problems)  # at most the last
    assert records[-1]["gradients"]["read"] == "scaled"
    assert os.path.getsize(log) > 0


def test_a_watch_only_log_ends_with_the_watch_findings(tmp_path: Path) -> None:
    # `ampdoctor report` on a log written by watch() alone (no `ampdoctor run` to append a report) used to find
    # no findings: the end line had the numbers but not AMP603/AMP604.
    from ampdoctor.ui.report_files import load_any

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(1e5)  # fp16 output overflows at every step: every step skipped
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with watch(model, opt, scaler, log_dir=str(tmp_path)) as w:
        for _ in range(12):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.ones(2, 4)).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    end = read_log(tmp_path / LOG_NAME)[1][-1]
    assert end["type"] == "end"
    codes = {f["code"] for f in end["findings"]}
    assert codes == {f.code for f in w.findings()} and "AMP601" in codes  # the overflowing Linear is named
    assert {f.code for f in load_any(str(tmp_path / LOG_NAME)).report.findings} == codes


def _train(log_dir: Path, steps: int) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, opt, every=1, log_dir=str(log_dir)):
        for _ in range(steps):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()


def test_a_restart_appends_a_new_run_instead_of_truncating(tmp_path: Path, capsys) -> None:
    from ampdoctor.core.records import read_runs
    from ampdoctor.ui.cli import main

    _train(tmp_path, 3)
    with open(tmp_path / LOG_NAME, "ab") as f:
        f.write(b'{"type": "step", "step": 3, "gradi')   # the first run was killed mid-line
    _train(tmp_path, 2)   # the restarted job writes to the same folder
    runs = read_runs(tmp_path / LOG_NAME)
    assert len(runs) == 2 and runs[1].header["schema"] == SCHEMA and runs[1].header["started"] > 0
    assert [r["step"] for r in runs[0].records if r["type"] == "step"] == [0, 1, 2]   # not truncated
    assert runs[0].problems[0].startswith(f"line {runs[1].line - 1}: not JSON")       # the torn line, alone
    header, records, problems = read_log(tmp_path / LOG_NAME)   # the last run
    assert problems == [] and [r["step"] for r in records if r["type"] == "step"] == [0, 1]
    assert main(["report", str(tmp_path / LOG_NAME)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert ("this file holds 2 runs (a restart or the watch's next stage appends one): showing the last, run 2 "
            f"from line {runs[1].line}") in shown
    assert "run 1 from line 1 (3 sampled steps, ended)" in shown


def test_the_watchs_stages_are_runs_of_the_log_counted_by_their_sampled_steps(tmp_path: Path, capsys) -> None:
    # three folds of 5 steps: the first stage is watched from its first step, the next two from their new
    # optimizer's third; each stage's detach writes a partial line that repeats its last step, which was counted
    # as one more sampled step ("6 sampled steps" for the first fold's 5)
    from ampdoctor.ui.cli import main

    script = Path(__file__).parents[1] / "scripts" / "kfold_scaled.py"
    assert main(["run", "--log-dir", str(tmp_path), str(script)]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / LOG_NAME)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "this file holds 3 runs (a restart or the watch's next stage appends one)" in shown
    assert "run 1 from line 1 (5 sampled steps, ended), run 2 from line 9 (3 sampled steps, ended)" in shown


def test_each_rank_writes_its_own_file_and_a_single_process_keeps_the_old_name(tmp_path: Path,
                                                                                monkeypatch) -> None:
    from ampdoctor.core.records import rank_of_log

    with FlightRecorder(tmp_path, {}) as single:
        pass
    assert single.path.name == LOG_NAME and "rank" not in read_log(single.path)[0]
    for rank in ("0", "1"):   # the watch reads this process's rank (ranks.info) and passes it on
        with FlightRecorder(tmp_path, {}, rank=int(rank), world_size=2) as rec:
            rec.write({"type": "step", "step": 0})
        assert rank_of_log(rec.path) == int(rank)
        assert (read_log(rec.path)[0]["rank"], read_log(rec.path)[0]["world_size"]) == (int(rank), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOG_NAME, "ampdoctor.rank0.jsonl", "ampdoctor.rank1.jsonl"]
