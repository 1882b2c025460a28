"""core/records.py: the record format written and read in one place, its one roll-up, and logs of the old schema."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from strict_json_check import strict_loads
from torch import nn

import ampdoctor
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.records import (
    OLD_WATCH_SCHEMAS,
    WATCH_SCHEMA,
    FlightRecorder,
    Layout,
    WatchSummary,
    append_report,
    gradient_rows,
    gradients_entry,
    lost_updates_entry,
    read_log,
    read_recording,
    read_runs,
    read_step,
    rollup,
    scale_entry,
)
from ampdoctor.core.report import Report
from ampdoctor.core.strict_json import json_text
from ampdoctor.monitor.grad_stats import COLUMNS, GradStats
from ampdoctor.monitor.header import log_header

V1_LOG = Path(__file__).parents[1] / "data" / "watch_v1.jsonl"  # written by ampdoctor at 2c84e2c, trimmed
V1 = "ampdoctor.watch/1"
# NaN/Infinity tokens, as ampdoctor wrote them before strict JSON: tests/scripts/short_overflow.py run with --log-dir
# by ampdoctor at e4dd0e2, trimmed to its header, two steps, its end and its report
NAN_TOKENS_LOG = Path(__file__).parents[1] / "data" / "watch_v2_nan_tokens.jsonl"


def _row(**counts: float) -> list[float]:
    """One row of ``COLUMNS`` with the given counts, 0 elsewhere."""
    return [float(counts.get(name, 0.0)) for name in COLUMNS]


def test_what_is_written_is_read_back(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model(torch.randn(5, 4)).pow(2).sum().backward()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    modules = [n.rsplit(".", 1)[0] for n in names]
    flat = GradStats([p.numel() for p in params]).compute([p.grad for p in params], 1024.0, False)
    rows = gradient_rows(flat.reshape(-1).tolist(), len(COLUMNS))
    described = [{"name": n, "module": m, "dtype": "float32", "shape": list(p.shape)}
                 for n, m, p in zip(names, modules, params)]
    header = log_header(torch.optim.SGD(params, lr=0.1), None, every=1, stats="full", sample=4096, params=described)
    finding = Finding("AMP607", Severity.WARNING, "0.weight", "lost", step=1)
    with FlightRecorder(tmp_path, header) as rec:
        rec.write({"type": "step", "step": 0, "t": 0.1,
                   "gradients": gradients_entry(rows, COLUMNS, read="scaled", loss_scale=1024.0, clip=[9.0, 1.0, 1.0]),
                   "scale": scale_entry(0, 1, 512.0, [[0, 1024.0]], [0], 1, 1),
                   "lost_updates": lost_updates_entry([("0.weight", 12, 3), ("0.bias", 3, 3), ("1.bias", 0, 0)])})
        rec.close({"steps": 1, "summary": {"steps": 1}, "environment": {"torch": "x"}, "findings": [finding]})
    append_report(rec.path, Report([finding], environment={}).to_dict())

    [run] = read_runs(rec.path)
    assert run.problems == [] and run.header["schema"] == WATCH_SCHEMA
    recording = read_recording(run.header, run.records)
    assert recording.notes == [] and recording.ended and recording.findings == [finding]
    assert recording.header.layout == Layout(tuple(COLUMNS), tuple(names), tuple(modules))
    assert Report.from_dict(recording.report).findings == [finding] and recording.environment == {"torch": "x"}
    [step] = recording.steps
    grads = step.gradients
    norms = [p.grad.norm().item() for p in params]
    assert grads.read == "scaled" and grads.loss_scale == 1024.0 and grads.clipped_scaled and grads.pre_clip_norm == 9
    assert grads.global_norm == pytest.approx(math.sqrt(sum(n * n for n in norms)), rel=1e-6)
    assert grads.modules() == rollup(rows, COLUMNS, modules) and set(grads.modules()) == {"0", "1"}
    assert grads.modules()["0"]["l2"] == pytest.approx(math.hypot(norms[0], norms[1]), rel=1e-6)
    assert grads.params()["1.weight"]["l2"] == pytest.approx(norms[2], rel=1e-6)
    assert (step.scale.first, step.scale.end, step.scale.scale, step.scale.changes) == (0, 1, 512.0, ((0, 1024.0),))
    assert step.skipped and step.scale.skipped_total == 1
    assert (step.lost.moved, step.lost.lost, step.lost.fraction) == (15, 6, 0.4)
    assert {n: (p.moved, p.lost) for n, p in step.lost.params.items()} == {"0.weight": (12, 3), "0.bias": (3, 3)}


def test_a_watch_summary_and_its_log_give_the_same_numbers(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with ampdoctor.watch(model, opt, every=1, log_dir=str(tmp_path)) as w:
        for _ in range(3):
            model(torch.randn(4, 16, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    summary = w.summary_data()
    recording = read_recording(*read_log(tmp_path)[:2])
    assert recording.steps[-1].gradients.modules() == summary["gradients"]["modules"]
    assert recording.steps[-1].gradients.params() == summary["gradients"]["params"]
    assert recording.lost_fraction() == summary["lost_updates"]["lost_fraction"] > 0
    assert recording.lost_by_param() == {n: s["lost_fraction"] for n, s in summary["lost_updates"]["params"].items()}
    assert json.loads(json.dumps(recording.end.summary.to_dict())) == json.loads(json.dumps(summary))


def test_a_log_of_inf_and_nan_is_strict_json_and_reads_back_as_floats(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampdoctor.watch(model, opt, every=1, log_dir=str(tmp_path)) as w:
        for scale in (1.0, math.inf):   # the second step's loss and gradients are inf and NaN
            (model(torch.randn(5, 4)).pow(2).mean() * scale).backward()
            opt.step()
            opt.zero_grad()
    append_report(w.log_path, Report(environment={}, extra={"watch": w.watch_summary()}).to_dict())
    lines = [strict_loads(line) for line in Path(w.log_path).read_text().splitlines()]
    assert [line["type"] for line in lines] == ["header", "step", "step", "end", "report"]
    assert lines[2]["gradients"]["global_norm"] == "nan" and lines[2]["gradients"]["rows"][0][2:4] == ["nan", "inf"]
    recording = read_recording(*read_log(w.log_path)[:2])
    grads = recording.steps[1].gradients   # absmax NaN, min_nonzero inf (no finite entry): as the rows were written
    assert math.isnan(grads.global_norm) and math.isnan(grads.rows[0][2]) and grads.rows[0][3] == math.inf
    assert grads.params()["0.weight"]["min_nonzero"] == math.inf
    for summary in (Report.from_dict(recording.report).watch, recording.end.summary):
        gradients = summary.gradients
        assert math.isnan(gradients.global_norm) and gradients.params["0.weight"].min_nonzero == math.inf


def test_a_log_with_the_old_nan_tokens_reads_as_its_strict_copy(tmp_path):
    old = NAN_TOKENS_LOG.read_text()
    assert "NaN" in old and "Infinity" in old
    strict = tmp_path / "ampdoctor.jsonl"
    strict.write_text("".join(json_text(json.loads(line), separators=(",", ":")) + "\n" for line in old.splitlines()))
    read = []
    for path in (NAN_TOKENS_LOG, strict):
        header, records, problems = read_log(path)
        assert problems == []
        recording = read_recording(header, records)
        read.append((recording, Report.from_dict(recording.report)))
    (old_log, old_report), (new_log, new_report) = read
    # the same views (repr: NaN is not equal to itself): the steps, the end's summary, the report
    assert repr((new_log.steps, new_log.end, new_report)) == repr((old_log.steps, old_log.end, old_report))
    assert math.isnan(new_log.steps[0].gradients.global_norm) and math.isnan(new_log.steps[0].loss.value)
    assert new_report.watch.gradients.modules["1.wo"].min_nonzero == math.inf


def test_a_module_share_pools_counts_over_the_signal_entries():
    # a large weight examined on 100 of its 1000 entries, 10 of them signal and 5 of those flushed in fp16, next
    # to a small bias examined whole, all 10 entries signal, none flushed
    weight = _row(has_grad=1, numel=1000, absmax=2.0, min_nonzero=1e-9, l2=3.0, nonfinite=0, zeros=500, negligible=100,
                  sampled=100, sampled_nonzero=10, fp16_underflow=5, fp16_subnormal=6)
    bias = _row(has_grad=1, numel=10, absmax=0.5, min_nonzero=1e-3, l2=4.0, nonfinite=2, zeros=0, negligible=0,
                sampled=10, sampled_nonzero=10, fp16_underflow=0, fp16_subnormal=1)
    no_grad = _row(has_grad=0, numel=7)
    module = rollup([weight, bias, no_grad], COLUMNS, ["fc", "fc", "fc"])["fc"]
    assert module["fp16_underflow"] == 5 / 20 and module["fp16_subnormal"] == 7 / 20
    weighted_by_sampled = (0.5 * 100 + 0.0 * 10) / 110   # what the console said before: 45% instead of 25%
    assert module["fp16_underflow"] != pytest.approx(weighted_by_sampled)
    assert module["zero_frac"] == 500 / 1010 and module["negligible_frac"] == 100 / 1010
    assert (module["params"], module["numel"], module["nonfinite"]) == (2, 1010, 2)
    assert (module["l2"], module["absmax"], module["min_nonzero"]) == (5.0, 2.0, 1e-9)
    # one parameter alone: its own share, as rows_to_dicts has always given it
    assert rollup([weight], COLUMNS, ["fc"])["fc"]["fp16_underflow"] == 0.5


def test_norms_only_rows_roll_up_to_norms_only():
    rows = [_row(has_grad=1, numel=4, absmax=1.0, l2=2.0, sampled=math.nan, sampled_nonzero=math.nan)]
    assert rollup(rows, COLUMNS, ["fc"]) == {"fc": {"params": 1, "numel": 4, "absmax": 1.0, "l2": 2.0}}


def test_a_v1_log_still_reads_and_says_what_it_lacks(capsys):
    header, records, problems = read_log(V1_LOG)
    assert problems == [] and header["schema"] == V1 in OLD_WATCH_SCHEMAS
    recording = read_recording(header, records)
    assert [s.step for s in recording.steps] == [0, 1] and recording.ended
    # the per-parameter fractions convert; the step's pooled fraction needs the counts /1 did not record
    assert {n: p.fraction for n, p in recording.steps[0].lost.params.items()} == {
        "0.weight": 0.5, "0.bias": 2 / 3, "1.weight": 1 / 3, "1.bias": 0.0}
    assert all(s.lost.fraction is None and s.lost.moved is None for s in recording.steps)
    assert recording.lost_fraction() is None
    assert recording.lost_by_param() == pytest.approx({"0.weight": 0.375, "0.bias": 2 / 3, "1.weight": 5 / 12,
                                                       "1.bias": 0.0})  # the old summary's, steps moving alike
    assert recording.notes == [f"written by an older ampdoctor (ampdoctor.watch/1): {OLD_WATCH_SCHEMAS[V1]}"]
    # the numbers ampdoctor 2c84e2c's watch summary gave for the last step
    modules = recording.steps[-1].gradients.modules()
    assert modules["0"]["l2"] == pytest.approx(0.3547750896892151)
    assert modules["1"]["l2"] == pytest.approx(0.5410931201738868)
    assert modules["0"]["min_nonzero"] == 0.01055908203125 and modules["0"]["fp16_underflow"] == 0.0
    assert [(f.code, f.where) for f in recording.findings] == [("AMP607", "0.bias")]

    from ampdoctor.ui.cli import main
    from ampdoctor.ui.report_files import load_any, run_data

    data = run_data(load_any(str(V1_LOG)))
    assert data.lost == [] and data.notes == recording.notes and len(data.global_norm) == 2
    assert main(["report", str(V1_LOG)]) == 0
    assert "written by an older ampdoctor (ampdoctor.watch/1)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("line", [
    {"type": "step", "step": 0, "gradients": {"rows": [["a"] * len(COLUMNS), [10**400] * len(COLUMNS), 5],
                                              "global_norm": "x", "loss_scale": True}},
    {"type": "step", "step": 0, "lost_updates": {"params": {"w": {"moved": 2, "lost": 3}}, "moved": -1, "lost": 0}},
    {"type": "step", "step": 0, "lost_updates": {"params": [1], "moved": 2, "lost": 1},
     "scale": {"steps": [0], "scale_changes": [[0], ["a", 1.0]], "skipped": ["1"]}},
    {"type": "step", "step": 0, "activations": {"sampled": 1, "forward": [], "headroom": {"ratio": "big"}}},
])
def test_values_of_the_wrong_type_read_as_absent(line):
    layout = Layout(tuple(COLUMNS), ("w", "b", "c"), ("fc", "fc", "fc"))
    step = read_step(line, layout)
    assert step.gradients is None or (step.gradients.global_norm is None and step.gradients.loss_scale is None
                                      and step.gradients.rows == (None, None, None) and step.gradients.modules() == {})
    assert step.lost is None or step.lost.params == {}
    assert step.scale is None or (step.scale.first is None and step.scale.changes == () and step.scale.skipped == ())
    assert step.activations is None or (not step.activations.sampled and step.activations.ratio is None)


def test_a_report_round_trips_and_a_malformed_finding_is_named():
    finding = Finding("AMP101", Severity.ERROR, "fc.weight", "float16", step=2, process="pid 7", cause="half",
                      ranks=(0, 1))
    report = Report([finding], exception={"type": "ValueError", "message": "x"}, environment={"torch": "2"},
                    changes=["upcast fc"], extra={"watch": WatchSummary(steps=3)}, observed={"models": 1},
                    exit_status=1)
    again = Report.from_dict(json.loads(report.to_json()))
    assert again == report and again.to_dict() == report.to_dict()
    assert report.to_dict()["findings"][0]["title"] == "Trainable float16 parameters under an fp16 GradScaler"
    with pytest.raises(ValueError, match=r"malformed finding \{'code': 'AMP101', 'severity': 'fatal'"):
        Report.from_dict({"schema": report.to_dict()["schema"], "findings": [
            {"code": "AMP101", "severity": "fatal", "where": "x", "detail": "y"}]})
    with pytest.raises(ValueError, match="expected schema 'ampdoctor.core.report/1', got 'ampdoctor.watch/2'"):
        Report.from_dict({"schema": WATCH_SCHEMA})
