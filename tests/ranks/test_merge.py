"""The merge of the ranks' reports into one: findings seen by several ranks once, their details, the missing ranks,
AMP411, the labels of a rank that reports itself, and a folder of per-rank flight recorders read together."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.records import FlightRecorder
from ampdoctor.core.report import Report
from ampdoctor.ranks.merge import disagreements, merge_rank_reports, rank_path
from ampdoctor.ui.report_files import load_any

HALF = "2.weight (float16, [4, 16]) is trainable float16"


def _report(*findings: Finding, exception: str | None = None) -> Report:
    report = Report(list(findings), observed={"models": 1, "optimizers": 1, "scalers": 1})
    if exception:
        report.exception = {"type": exception, "message": "boom", "traceback": ""}
    return report


def test_findings_seen_by_every_rank_merge_and_those_that_differ_stay_apart() -> None:
    same = Finding("AMP101", Severity.ERROR, "2", HALF)
    merged = merge_rank_reports({
        1: _report(same, Finding("AMP603", Severity.WARNING, "0", "12% underflow"),
                   Finding("AMP603", Severity.WARNING, "0", "2% underflow", step=9)),
        0: _report(same, Finding("AMP603", Severity.WARNING, "0", "3% underflow")),
    }, expected=range(2))
    assert [(f.code, f.detail, f.ranks, f.step) for f in merged.findings] == [
        ("AMP101", HALF, (0, 1), None),
        ("AMP603", "3% underflow\nThe numbers above are rank 0's.\nOn rank 1: 12% underflow", (0, 1), None),
        ("AMP603", "2% underflow", (1,), 9)]   # another step: apart
    assert merged.extra["ranks"]["details"] == [
        {"code": "AMP603", "where": "0", "step": None, "rank": 0, "detail": "3% underflow"},
        {"code": "AMP603", "where": "0", "step": None, "rank": 1, "detail": "12% underflow"}]
    assert merged.observed == {"models": 2, "optimizers": 2, "scalers": 2}
    assert merged.missing_ranks == [] and not merged.ok


def test_a_finding_every_rank_saw_with_its_own_numbers_is_one_finding_naming_each_difference() -> None:
    def first_nonfinite(rank: int, absmax: str) -> Finding:
        return Finding("AMP601", Severity.ERROR, "0 (Linear)", f"output NaN at step 1 on rank {rank}: the first "
                       f"module\nOrigin: to_copy: abs-max {absmax} -> inf\nFrames", step=1)
    merged = merge_rank_reports({r: _report(first_nonfinite(r, f"{r + 2}e+05")) for r in range(6)})
    [finding] = merged.findings
    assert finding.ranks == tuple(range(6))
    assert finding.detail.splitlines() == [
        "output NaN at step 1 on rank 0: the first module", "Origin: to_copy: abs-max 2e+05 -> inf", "Frames",
        "The numbers above are rank 0's.", "On rank 1: Origin: to_copy: abs-max 3e+05 -> inf",
        "On rank 2: Origin: to_copy: abs-max 4e+05 -> inf", "On rank 3: Origin: to_copy: abs-max 5e+05 -> inf",
        "2 more ranks saw other numbers; the JSON report has each rank's detail (ranks.details)."]
    assert [d["rank"] for d in merged.extra["ranks"]["details"]] == list(range(6))
    # the same words on every rank but the rank's own number: one detail, no per-rank lines
    merged = merge_rank_reports({r: _report(first_nonfinite(r, "2e+05")) for r in range(2)})
    assert merged.findings[0].detail == first_nonfinite(0, "2e+05").detail and "details" not in merged.extra["ranks"]


def test_the_first_crash_is_the_reports_exception_and_a_missing_rank_is_never_all_clear() -> None:
    merged = merge_rank_reports({0: _report(exception="RuntimeError"), 1: _report(exception="ValueError")},
                                expected=range(3), failed_at={0: 20.0, 1: 10.0})
    assert merged.exception["type"] == "ValueError" and merged.exception["rank"] == "1"
    assert [e["rank"] for e in merged.extra["ranks"]["exceptions"]] == [0, 1]
    clean = merge_rank_reports({0: _report()}, expected=range(2))
    assert clean.findings == [] and clean.exception is None
    assert not clean.ok and clean.missing_ranks == [1]   # rank 1 was not diagnosed: no all-clear
    assert "no report from rank 1" in clean.to_dict()["why_not_ok"]


def test_ranks_survive_the_json_and_stay_out_of_it_for_one_process() -> None:
    merged = merge_rank_reports({0: _report(Finding("AMP101", Severity.ERROR, "2", HALF)),
                                 1: _report(Finding("AMP101", Severity.ERROR, "2", HALF))}, expected=range(2))
    data = json.loads(merged.to_json())
    assert data["findings"][0]["ranks"] == [0, 1]
    back = Report.from_dict(data)
    assert back.findings[0].ranks == (0, 1) and back.missing_ranks == []
    assert "ranks" not in Finding("AMP101", Severity.ERROR, "2", HALF).to_dict()


def test_the_console_says_on_which_ranks() -> None:
    merged = merge_rank_reports({r: _report(Finding("AMP101", Severity.ERROR, "2", HALF)) for r in range(5)},
                                expected=range(6))
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(merged)
    text = out.getvalue()
    assert "\n    on ranks 0-4\n" in text
    assert "ampdoctor: no report from rank 5" in text


def test_report_reads_a_folder_of_per_rank_logs_together(tmp_path: Path, monkeypatch) -> None:
    for rank, detail in ((0, "3% underflow"), (1, "12% underflow")):
        rec = FlightRecorder(tmp_path, {"params": []}, rank=rank, world_size=2)   # as each rank's watch opens it
        rec.write({"type": "step", "step": 0, "findings": [
            Finding("AMP101", Severity.ERROR, "2", HALF).to_dict(),
            Finding("AMP603", Severity.WARNING, "0", detail).to_dict()]})
        if rank == 0:
            rec.close({"steps": 1})
        # rank 1 is "killed": no end line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ampdoctor.rank0.jsonl", "ampdoctor.rank1.jsonl"]
    loaded = load_any(str(tmp_path))
    assert [(f.code, f.ranks) for f in loaded.report.findings] == [("AMP101", (0, 1)), ("AMP603", (0, 1))]
    assert loaded.report.findings[1].detail.endswith("\nOn rank 1: 12% underflow")
    assert loaded.notes[0] == "rank 0: 1 sampled step, last sampled step 0; ended"
    assert loaded.notes[1].startswith("rank 1: 1 sampled step, last sampled step 0; no end line")
    assert sorted(loaded.ranks) == [0, 1] and loaded.run.header.rank == 0


@pytest.mark.parametrize("path, rank, expected", [("out/r.json", 1, "out/r.rank1.json"), ("r", 2, "r.rank2")])
def test_a_rank_reporting_itself_writes_its_own_json(path: str, rank: int, expected: str) -> None:
    assert rank_path(path, rank) == expected


def _watched_report(inf_at: set[int]):
    # one rank's real watch: a GradScaler run in which this rank's gradient is inf at the given steps
    import torch
    from torch import nn

    import ampdoctor

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, opt, scaler, every=1) as w:
        for step in range(5):
            scaler.scale(model(torch.ones(2, 4)).sum()).backward()
            if step in inf_at:
                model.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return w.report()


def test_ranks_that_skipped_different_steps_get_amp411_from_their_reports():
    # FSDP1 with a plain GradScaler: each rank decides from its own shard. The merge compares the ranks' recorded
    # skips and scales (from the report files, no collective) and says where they first differ.
    apart = disagreements({0: _watched_report({1}), 1: _watched_report(set())})
    assert [(f.code, f.step) for f in apart] == [("AMP411", 1)]
    assert "rank 0 skipped the step while rank 1 applied it; 1 of the 5 steps compared was skipped" in apart[0].detail
    two = disagreements({0: _watched_report({1, 3}), 1: _watched_report(set())})[0].detail
    assert "2 of the 5 steps compared were skipped on some ranks only" in two
    assert disagreements({0: _watched_report({1}), 1: _watched_report({1})}) == []  # they agree: quiet
