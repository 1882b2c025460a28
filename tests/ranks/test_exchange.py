"""The hand-over of the ranks' reports to rank 0 in one process: its deadline, stale files, a refused folder, the
job's c10d store, a rank that died, and SIGTERM while rank 0 waits."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from strict_json_check import strict_loads
from torch import nn

from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.options import RunOptions
from ampdoctor.core.records import WatchSummary
from ampdoctor.core.report import Report
from ampdoctor.core.views import Line
from ampdoctor.ranks import exchange as rank_exchange
from ampdoctor.ranks.exchange import RankExchange
from ampdoctor.ranks.info import RankInfo
from ampdoctor.ranks.job import JobEnd, end_job
from ampdoctor.runner.doctor import Doctor

HALF = "2.weight (float16, [4, 16]) is trainable float16"


def _report(*findings: Finding, exception: str | None = None) -> Report:
    report = Report(list(findings), observed={"models": 1, "optimizers": 1, "scalers": 1})
    if exception:
        report.exception = {"type": exception, "message": "boom", "traceback": ""}
    return report


def _pair(tmp_path: Path, world: int = 2) -> list[RankExchange]:
    return [RankExchange(RankInfo(r, world, r, world, 0, "job"), folder=str(tmp_path)) for r in range(world)]


def test_rank_0_merges_what_the_other_ranks_wrote_and_clears_the_folder(tmp_path: Path) -> None:
    zero, one = _pair(tmp_path)
    zero.start()
    one.start()
    assert one.send(_report(Finding("AMP101", Severity.ERROR, "2", HALF)), 0, False, None)
    merged = zero.collect(_report(Finding("AMP101", Severity.ERROR, "2", HALF)), 0, False, None)
    assert [f.ranks for f in merged.findings] == [(0, 1)] and merged.missing_ranks == []
    zero.announce(merged)
    assert not os.path.exists(zero.mailbox.folder)


def test_rank_0_waits_until_its_deadline_then_names_the_missing_rank(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(rank_exchange.ENV_WAIT, "0.3")
    zero, _ = _pair(tmp_path)
    zero.start()
    started = time.monotonic()
    merged = zero.collect(_report(), 0, False, None)
    assert 0.25 < time.monotonic() - started < 5
    assert merged.missing_ranks == [1] and not merged.ok
    assert "no report from rank 1 (none within 0.3 s)" in merged.extra["ranks"]["notes"][0]


def test_a_file_an_earlier_launch_left_behind_is_not_merged(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(rank_exchange.ENV_WAIT, "0.2")
    old, _ = _pair(tmp_path)
    old.send(_report(Finding("AMP104", Severity.ERROR, "opt", "eps")), 1, False, 1.0)   # as a killed job's rank
    stale = Path(old.mailbox.folder) / "rank0"
    os.replace(stale, Path(old.mailbox.folder) / "rank1")
    os.utime(Path(old.mailbox.folder) / "rank1", (time.time() - 600, time.time() - 600))
    zero, _ = _pair(tmp_path)
    zero.start()
    merged = zero.collect(_report(), 0, False, None)
    assert merged.findings == [] and merged.missing_ranks == [1]


def test_a_failed_rank_prints_its_own_report_when_rank_0_never_collects(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(rank_exchange.ENV_WAIT, "0.2")
    _, one = _pair(tmp_path)
    one.start()
    own = _report(Finding("AMP401", Severity.ERROR, "optimizer[0]", "twice"), exception="RuntimeError")
    assert one.send(own, 1, True, time.time())
    mine, lines = one.unreported(own, 1, True)
    assert mine is not None and [f.ranks for f in mine.findings] == [(1,)] and mine.exception["rank"] == "1"
    assert json.loads((Path(one.mailbox.folder) / "rank1").read_text())["printed"] is True


def test_a_failed_rank_stays_quiet_when_rank_0_reported_it(tmp_path: Path) -> None:
    zero, one = _pair(tmp_path)
    zero.start()
    one.start()
    own = _report(Finding("AMP101", Severity.ERROR, "2", HALF), exception="ValueError")
    one.send(own, 1, True, time.time())

    def rank_0() -> None:
        merged = zero.collect(own, 1, True, time.time())
        zero.announce(merged)

    thread = threading.Thread(target=rank_0)
    thread.start()
    mine, lines = one.unreported(own, 1, True)   # rank 0 runs in a thread: no SIGTERM handler is installed there
    thread.join(timeout=30)
    assert mine is None and lines == ["rank 1's failure is in rank 0's report"]


def test_sigterm_while_rank_0_waits_ends_the_wait_and_is_delivered_again(tmp_path: Path, monkeypatch) -> None:
    from ampdoctor.session.termination import Termination

    monkeypatch.setenv(rank_exchange.ENV_WAIT, "30")
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)   # as in a script that sets no handler of its own ...
        termination = Termination(lambda: None)
        termination.begin_end()   # ... whose run is ending: a SIGTERM now only cuts the waits short
        zero = RankExchange(RankInfo(0, 2, 0, 2, 0, "job"), folder=str(tmp_path), stopped=termination.stopped)
        zero.start()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()   # torchrun stopping the job
        started = time.monotonic()
        merged = zero.collect(_report(), 0, False, None)
        assert time.monotonic() - started < 10 and termination.received
        assert "no report from rank 1 (the job was stopped first)" in merged.extra["ranks"]["notes"][0]
        signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
        termination._previous = signal.getsignal(signal.SIGTERM)   # the script's handler, to see the delivery
        signal.signal(signal.SIGTERM, termination._on_sigterm)
        termination.release()   # the signal is delivered again now that the run has ended
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_folder_that_others_can_write_is_refused_and_the_ranks_report_themselves(tmp_path: Path) -> None:
    info = RankInfo(0, 2, 0, 2, 0, "job")
    folder = tmp_path / f"ampdoctor-{os.getuid()}-ranks-job"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)   # as if another user had made it ready for this job's name
    zero = RankExchange(info, folder=str(tmp_path))
    assert zero.mailbox is None and not zero.collects
    assert "can be written by other users (mode 777)" in zero.notes[0]
    merged = zero.collect(_report(), 0, False, None)
    assert merged.missing_ranks == [1]
    assert any("can be written by other users" in note for note in merged.extra["ranks"]["notes"])


def test_the_folder_is_made_for_this_user_alone(tmp_path: Path) -> None:
    zero = RankExchange(RankInfo(0, 2, 0, 2, 0, "job"), folder=str(tmp_path))
    assert oct(os.stat(zero.mailbox.folder).st_mode & 0o777) == "0o700"


def test_reports_travel_through_the_jobs_c10d_store(monkeypatch) -> None:
    # torchrun's agent hosts a TCPStore for the job (TORCHELASTIC_USE_AGENT_STORE=True); here the test hosts one
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    zero, one = (RankExchange(RankInfo(r, 2, r, 1, r, "job")) for r in range(2))   # one rank per node
    assert "c10d store" in zero.where and not zero.node_only and one.collects   # no folder every node can read
    zero.start()
    one.start()
    assert one.send(_report(Finding("AMP101", Severity.ERROR, "2", HALF)), 0, False, None)
    merged = zero.collect(_report(Finding("AMP101", Severity.ERROR, "2", HALF)), 0, False, None)
    assert [f.ranks for f in merged.findings] == [(0, 1)] and merged.missing_ranks == []
    zero.announce(merged)
    assert not server.check(["ampdoctor/job/rank1"])   # cleared


@pytest.mark.parametrize("where", ["folder", "store"])
def test_a_rank_report_of_inf_and_nan_travels_as_strict_json(where, tmp_path: Path, monkeypatch) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    if where == "store":
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(server.port))
        zero, one = (RankExchange(RankInfo(r, 2, r, 1, r, "job")) for r in range(2))
    else:
        zero, one = _pair(tmp_path)
    summary = WatchSummary.from_dict({"steps": 2, "gradients": {"global_norm": math.nan, "max_global_norm": {
        "step": 1, "value": math.inf}}, "loss": {"last": [1, math.nan]}})
    zero.start()
    one.start()
    report = _report(Finding("AMP101", Severity.ERROR, "2", HALF))
    report.extra.update(watch=summary, clipping={"max_norm": 1.0, "peak": math.inf, "last": math.nan})
    assert one.send(report, 0, False, None)
    sent = dist.PrefixStore("ampdoctor/job/", server).get("rank1").decode() if where == "store" else \
        Path(zero.mailbox.path("rank1")).read_text()
    assert strict_loads(sent)["report"]["clipping"] == {"max_norm": 1.0, "peak": "inf", "last": "nan"}
    merged = zero.collect(report, 0, False, None)
    assert merged.missing_ranks == [] and [f.ranks for f in merged.findings] == [(0, 1)]
    assert math.isnan(merged.watch.gradients.global_norm) and merged.watch.gradients.max_global_norm == (1, math.inf)
    assert repr(merged.watch.loss.last) == "(1, nan)"


def test_a_rank_whose_process_is_gone_died_and_failed_first(tmp_path: Path, monkeypatch) -> None:
    import subprocess
    import sys

    monkeypatch.setenv(rank_exchange.ENV_WAIT, "0.2")
    zero, one = (RankExchange(RankInfo(r, 2, r, 2, 0, "job"), folder=str(tmp_path)) for r in range(2))
    zero.start()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    one.start()
    one.mailbox.put("started1", {**one.mailbox.get("started1"), "pid": int(gone.stdout)})   # then it was killed
    crashed = _report(exception="DistBackendError")
    crashed.exception["message"] = "[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection reset by peer"
    merged = zero.collect(crashed, 1, False, time.time())
    ranks = merged.extra["ranks"]
    assert ranks["missing"] == [1] and ranks["died"] == [1] and ranks["failed_first"] == 1
    lines = zero.summary_lines(merged)
    assert any(line.startswith("rank 1 failed first: it died without a report") for line in lines), lines


def _real_crash(kind: str) -> tuple[Report, bool]:
    """A rank's own report of a real crash, and whether a rule explained it: ``"unscale"`` is the seed error (a
    ``.half()`` model under a GradScaler, AMP101), ``"shapes"`` a RuntimeError no rule knows."""
    model = nn.Linear(4, 2).half()
    optimizer, scaler = torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu")
    with Doctor(RunOptions(watch=False)) as doctor:
        try:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(3, 4 if kind == "unscale" else 5).half()).float().sum()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
        except (ValueError, RuntimeError) as exc:
            doctor.explain(exc)
    return doctor.report, bool(doctor.report.extra.get("explained_by"))


def test_ranks_that_failed_alike_are_one_line_and_another_failure_keeps_its_own(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(rank_exchange.ENV_WAIT, "20")
    exchanges = [RankExchange(RankInfo(r, 3, r, 3, 0, "job"), folder=str(tmp_path)) for r in range(3)]
    crashes = {0: _real_crash("unscale"), 1: _real_crash("unscale"), 2: _real_crash("shapes")}
    started = time.time()
    failed_at = {1: started, 0: started + 1, 2: started + 2}   # rank 1 first
    out = {r: io.StringIO() for r in range(3)}

    def end(rank: int) -> None:   # every rank's end, as attach() ends it, drawn as it draws (80 columns)
        console = Console(file=out[rank], width=80, highlight=False)
        report, explained = crashes[rank]
        end_job(report, JobEnd(1, explained, failed_at[rank]), exchanges[rank], exchanges[rank].info,
                lambda item: console.print(Line(item) if isinstance(item, str) else item, soft_wrap=True),
                lambda path, text: None)

    for exchange in exchanges:
        exchange.start()
    others = [threading.Thread(target=end, args=(r,)) for r in (1, 2)]   # no SIGTERM handler in a thread
    for thread in others:
        thread.start()
    end(0)
    for thread in others:
        thread.join(timeout=30)
    zero = out[0].getvalue().splitlines()
    failed = [line for line in zero if " failed " in line and line.startswith("ampdoctor: rank")]
    assert [line.split(" with ")[0] for line in failed] == ["ampdoctor: ranks 0, 1 failed",
                                                             "ampdoctor: rank 2 failed after it,"], zero
    assert "; rank 1 first" in "\n".join(zero) and "ValueError: Attempting to unscale" in failed[0]
    assert "RuntimeError: mat1 and mat2 shapes" in failed[1] and max(map(len, zero)) <= 80, zero
    assert "rank 1's failure is in rank 0's report" in out[1].getvalue()
