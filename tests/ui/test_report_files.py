"""ui/report_files.py, ui/run_data.py, ui/figures.py and ui/html_page.py: the report page from real runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

import ampdoctor
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.report import Report
from ampdoctor.core.strict_json import json_text
from ampdoctor.ui.figures import have_matplotlib, write_pngs
from ampdoctor.ui.report_files import combine, load_any, render_html, render_loaded, run_data, series, write_html

needs_matplotlib = pytest.mark.skipif(not have_matplotlib(), reason="matplotlib is not installed")
# NaN/Infinity tokens, as ampdoctor wrote them before strict JSON (tests/core/test_records.py says how it was made)
NAN_TOKENS_LOG = Path(__file__).parents[1] / "data" / "watch_v2_nan_tokens.jsonl"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wi, self.wo = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.wo(torch.relu(self.wi(x)))


def overflow_run(log_dir: Path, steps: int = 6, name: str = "ffn") -> ampdoctor.Watch:
    """Train a model whose `<name>.wo` output overflows fp16 under CPU autocast; keep a flight recorder."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("inp", nn.Linear(8, 16))
    model.add_module(name, Block())
    model.add_module("out", nn.Linear(16, 1))
    with torch.no_grad():
        model.get_submodule(name).wo.weight.mul_(3e5)  # fine in fp32, above 65504 in fp16
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, opt, scaler, every=1, log_dir=str(log_dir), activations=True) as w:
        for _ in range(steps):
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return w


@pytest.fixture(scope="module")
def overflow_log(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("overflow")
    overflow_run(folder)
    return folder / "ampdoctor.jsonl"


def test_run_data_of_a_forward_overflow(overflow_log):
    data = run_data(load_any(str(overflow_log)))
    assert data.source == "log" and data.closed and data.sampled_steps == 6 and data.formats == ["fp16"]
    assert [s for s, _ in data.scale] == list(range(7)) and data.scale[0][1] == 65536.0
    assert data.scale[-1][1] == 65536.0 / 2 ** 6 and data.skipped == list(range(6))
    assert data.first_nonfinite.module == "ffn.wo" and data.first_nonfinite.frames
    assert set(data.module_norms) == {"inp", "ffn.wi", "ffn.wo", "out"}
    assert data.cast_steps == list(range(6)) and set(data.cast) >= {"fp16_underflow", "fp16_overflow", "nonfinite"}
    assert data.cast["nonfinite"]["ffn.wo"] == [1.0] * 6  # every gradient entry is inf/NaN
    assert [a.nonfinite_module for a in data.activations] == ["ffn.wo"] * 6


@needs_matplotlib
def test_page_of_a_forward_overflow(overflow_log, tmp_path):
    out = tmp_path / "report.html"
    write_html(load_any(str(overflow_log)), str(out))
    page = out.read_text(encoding="utf-8")
    verdict = page[page.index("id='verdict'"):page.index("</section>")]
    # the verdict is the report's (its error findings), as on the console; the numbers are in the sections below
    assert "verdict bad" in verdict and "errors" in verdict
    assert "<td>1024</td>" in page and "<b>ffn.wo</b> (Linear) at step 0" in page
    for key in ("loss_scale", "cast_fp16", "nonfinite_grads", "activations"):
        assert f"id='fig-{key}'><svg" in page
    assert "id='frames'" in page and "aten.addmm" in page and "id='environment'" in page
    assert "<script" not in page and not re.search(r"(src|href)=[\"']?(https?:|//)", page)  # no JS, nothing fetched


def test_underflow_series_is_a_share_of_entries_not_a_count(tmp_path):
    model = nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampdoctor.watch(model, opt, every=1, log_dir=str(tmp_path)):
        for _ in range(3):
            (model(torch.randn(4, 32)).sum() * 1e-12).backward()  # every gradient is below fp16's 6e-8
            opt.step()
            opt.zero_grad()
    data = run_data(load_any(str(tmp_path)))
    assert data.cast["fp16_underflow"]["(root)"] == [1.0, 1.0, 1.0]
    assert data.cast["bf16_underflow"]["(root)"] == [0.0, 0.0, 0.0]
    assert series(load_any(str(tmp_path)))["worst fp16 underflow"] == [(0, 1.0), (1, 1.0), (2, 1.0)]


def test_log_findings_keep_process_and_cause(tmp_path):
    log = tmp_path / "ampdoctor.jsonl"
    finding = {"code": "AMP101", "severity": "error", "where": "fc", "detail": "fc.w is half", "step": 3,
               "process": "pid 7: python train.py", "cause": "half"}
    log.write_text(json.dumps({"type": "header", "schema": "ampdoctor.watch/1"}) + "\n"
                   + json.dumps({"type": "step", "step": 3, "findings": [finding]}) + "\n")
    [got] = load_any(str(log)).report.findings
    assert (got.process, got.cause, got.step) == ("pid 7: python train.py", "half", 3)


def test_fifty_one_modules_with_one_cause_are_one_row(tmp_path):
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(51)]).half()  # a stray .half() on the whole model
    report = ampdoctor.check(model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu"))
    assert sum(f.code == "AMP101" for f in report.findings) == 51
    path = tmp_path / "report.json"
    path.write_text(report.to_json())
    page = render_html(load_any(str(path)))
    table = page[page.index("id='findings'"):page.index("</table>", page.index("id='findings'"))]
    rows = re.findall(r"<tr class='(\w+)'><td><b>(AMP\d+)</b>", table)
    assert rows == [("error", "AMP101"), ("error", "AMP104")]
    assert "Parameters in these 51 modules" in table and "and 43 more</summary>" in table
    assert "<p>2 errors, 0 warnings</p>" in page   # counted as the console lists them: one row each
    assert len(page) < 30_000  # the old page had one row per module: 51 rows


def test_truncated_log_still_renders(overflow_log, tmp_path):
    data = overflow_log.read_bytes()
    cut = data.rindex(b'{"type":"step"')
    torn = tmp_path / "ampdoctor.jsonl"
    torn.write_bytes(data[:cut + 300])  # killed while writing the last step's line: no end line
    loaded = load_any(str(torn))
    assert loaded.problems and "torn last line" in loaded.problems[-1]
    page = render_html(loaded)
    assert "without its end line: the run was killed" in page and "Reading problems" in page
    # no findings in a log without its end line: no verdict but "no all-clear"; the overflow its step records show
    assert "verdict partial" in page and "<b>ffn.wo</b>" in page
    text = _console(render_loaded(loaded))
    assert "torn last line" in text and "first inf/NaN in the forward pass: ffn.wo at step 0" in text


def test_json_report_alone_and_combined_with_its_log(tmp_path):
    w = overflow_run(tmp_path / "log", steps=4)
    path = tmp_path / "report.json"
    path.write_text(w.report().to_json())
    alone = load_any(str(path))
    data = run_data(alone)
    assert data.source == "report" and data.scale[0] == (0, 65536.0) and data.skipped == [0, 1, 2, 3]
    assert data.first_nonfinite.module == "ffn.wo" and "ffn.wo" in data.activation_modules
    page = render_html(alone)
    assert "watch summary" in page and "verdict bad" in page and "<b>AMP601</b>" in page and "id='activations'" in page
    both = combine(load_any(str(tmp_path / "log")), alone)
    assert both.report.findings == alone.report.findings and run_data(both).sampled_steps == 4
    assert "verdict bad" in render_html(both)


def test_verdicts_nothing_trained_and_crash():
    from types import SimpleNamespace

    from ampdoctor.ui.html_page import verdict
    from ampdoctor.ui.run_data import RunData

    idle = SimpleNamespace(report=Report(observed={"models": 0, "optimizers": 0, "scalers": 0}), problems=[])
    assert verdict(idle, RunData())[0] == "bad" and verdict(idle, RunData())[1][0].startswith("nothing was trained")
    crash = Report(exception={"type": "ValueError", "message": "Attempting to unscale FP16 gradients."},
                   findings=[Finding("AMP101", Severity.ERROR, "fc", "half")])
    kind, lines = verdict(SimpleNamespace(report=crash, problems=[]), RunData())
    assert kind == "bad" and lines == ["1 error, 0 warnings",
                                       "AMP101 Trainable float16 parameters under an fp16 GradScaler: fc",
                                       "the script crashed: ValueError: Attempting to unscale FP16 gradients."]


@pytest.mark.parametrize("argv, kind", [(["exit_status.py", "3"], "partial"), (["kfold_scaled.py"], "ok")])
def test_every_view_closes_with_the_console_verdict(argv, kind, tmp_path, capsys):
    """A script that exits 3 with no finding is no all-clear on the console; the page said 'ok: no errors or
    warnings' in green, and `ampdoctor report` on its flight recorder said nothing. A clean k-fold run earns the
    all-clear, its earlier stages included, in every view."""
    from ampdoctor.ui.cli import main
    from ampdoctor.ui.html_page import verdict

    scripts = Path(__file__).parent.parent / "scripts"
    report, logs = tmp_path / "report.json", tmp_path / "logs"
    main(["run", "--json", str(report), "--log-dir", str(logs), str(scripts / argv[0]), *argv[1:]])
    console = " ".join(capsys.readouterr().err.split())
    closing = re.findall(r"ampdoctor: ((?:no |the script exited).*?)(?= ampdoctor: |$)", console)[-1]
    assert ("this is no all-clear" in closing) == (kind == "partial")
    assert ("2 earlier stages" in closing) == (kind == "ok")
    for path in (report, logs / "ampdoctor.jsonl"):
        loaded = load_any(str(path))
        assert verdict(loaded, run_data(loaded)) == (kind, [closing])
        assert f"verdict {kind}" in render_html(loaded)
        out = Console(width=100, record=True, file=open(os.devnull, "w"))
        out.print(render_loaded(loaded))
        assert f"ampdoctor: {closing}" in " ".join(out.export_text().split())


def test_module_names_are_escaped_in_the_page(tmp_path):
    overflow_run(tmp_path, steps=2, name="<b>$x$</b>")
    page = render_html(load_any(str(tmp_path)))
    assert "<b>$x$</b>" not in page and "&lt;b&gt;$x$&lt;/b&gt;.wo" in page


@needs_matplotlib
def test_write_pngs(overflow_log, tmp_path):
    paths = write_pngs(load_any(str(overflow_log)), str(tmp_path / "png"))
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["activations.png", "cast_fp16.png", "grad_norms.png", "loss.png", "loss_scale.png",
                     "nonfinite_grads.png"]
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_without_matplotlib_tables_and_how_to_get_plots(overflow_log, tmp_path):
    # a child python where `import matplotlib` fails, as when the `report` extra is not installed
    code = textwrap.dedent(f"""
        import sys
        sys.modules["matplotlib"] = None
        from rich.console import Console
        from ampdoctor.ui.report_files import load_any, render_loaded, write_html
        from ampdoctor.ui.figures import write_pngs
        loaded = load_any({str(overflow_log)!r})
        write_html(loaded, {str(tmp_path / 'page.html')!r})
        Console(width=200).print(render_loaded(loaded))
        try:
            write_pngs(loaded, {str(tmp_path / 'png')!r})
        except ValueError as exc:
            print("PNG:", exc)
        print("matplotlib loaded:", any(m.startswith("matplotlib.") for m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "page.html").read_text(encoding="utf-8")
    assert "<svg" not in page and "plots need matplotlib, <code>pip install matplotlib</code>" in page
    assert "id='findings'" in page and "id='gradients'" in page and "id='frames'" in page
    assert "plots: pip install matplotlib, then ampdoctor report" in done.stdout
    assert "PNG: PNG figures need matplotlib: pip install matplotlib" in done.stdout
    assert "matplotlib loaded: False" in done.stdout


def _console(renderable) -> str:
    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    console.print(renderable)
    return console.export_text()


def test_a_merged_torchrun_report_shows_the_ranks_of_each_finding(tmp_path):
    from ampdoctor.core.findings import Finding, Severity
    from ampdoctor.core.report import Report
    from ampdoctor.ranks.merge import merge_rank_reports

    seed = Finding("AMP101", Severity.ERROR, "head", "head.weight (float16, [4, 16]) is trainable float16")
    overflow = Finding("AMP601", Severity.ERROR, "0 (Linear)", "output inf at step 1")
    merged = merge_rank_reports({0: Report([seed]), 1: Report([seed, overflow])})
    path = tmp_path / "r.json"
    path.write_text(merged.to_json())
    page = render_html(load_any(str(path)))
    assert "on ranks 0, 1" in page and "on rank 1<" in page


@pytest.mark.skipif(not have_matplotlib(), reason="needs matplotlib (the report extra)")
def test_activations_of_one_step_are_drawn_per_module_not_as_a_one_point_line(tmp_path):
    """A watch that looked at the activations of one step (dense=1 here; after trouble, one step too): a line
    "over sampled steps" would be one point; the page draws the modules of that step instead, and names it."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampdoctor.watch(model, opt, every=1, dense=1, log_dir=str(tmp_path)):
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    data = run_data(load_any(str(tmp_path)))
    assert [a.step for a in data.activations] == [0] and data.activation_modules
    page = render_html(load_any(str(tmp_path)))
    assert "Activation headroom per module at step 0" in page and "Activation headroom over" not in page
    assert "id='fig-activations'><svg" in page


def test_lost_updates_of_a_pure_bf16_run_reach_the_report(tmp_path):
    """The recorder wrote a step's lost updates as ``{param: fraction}`` and the report read ``["fraction"]``: a run
    with AMP607 had no lost-update series, column or figure."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)   # most updates are below half a bf16 ulp of the weights
    with ampdoctor.watch(model, opt, every=1, log_dir=str(tmp_path)) as w:
        for _ in range(5):
            model(torch.randn(8, 32, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert "AMP607" in {f.code for f in w.findings()}
    loaded = load_any(str(tmp_path))
    data = run_data(loaded)
    assert [s for s, _ in data.lost] == [0, 1, 2, 3, 4] and all(0 < v <= 1 for _, v in data.lost)
    assert series(loaded)["lost updates (fraction)"] == data.lost
    assert "lost updates (fraction)" in _console(render_loaded(loaded))
    if have_matplotlib():
        assert "id='fig-lost_updates'><svg" in render_html(loaded)


def test_a_modules_underflow_share_is_the_same_in_the_summary_and_on_the_page(tmp_path):
    """The watch summary weighted each parameter's share by the entries it examined, the page pooled the counts over
    the signal entries: with a weight half of whose gradient entries are 0 next to a bias with none, the console said
    one share and the heatmap another for the same module and step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    spread = torch.logspace(-7, 0, 16) * (torch.arange(16) % 2)   # half the inputs of model[2] are exactly 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, opt, scaler, every=1, log_dir=str(tmp_path)) as w:
        for _ in range(3):
            loss = model[2](model[1](model[0](torch.randn(4, 8))) * spread).pow(2).mean() * 1e-9
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    params = w.summary_data()["gradients"]["params"]
    assert params["2.weight"]["fp16_underflow"] > 0.1 and params["2.bias"]["zero_frac"] == 0.0
    summary = w.summary_data()["gradients"]["modules"]["2"]["fp16_underflow"]
    page = run_data(load_any(str(tmp_path))).cast["fp16_underflow"]["2"][-1]
    assert summary == pytest.approx(page, rel=1e-12)


def test_the_steps_of_a_log_are_plain_columns_in_a_pipe_and_a_table_on_a_terminal(tmp_path):
    # A CI log or `| tee` gets lines grep finds and no box drawing; a terminal gets rich's table. Both at 80 columns.
    overflow_run(tmp_path / "log", steps=3)
    loaded = load_any(str(tmp_path / "log" / "ampdoctor.jsonl"))
    drawn = {}
    for terminal in (False, True):
        console = Console(width=80, record=True, file=open(os.devnull, "w"), force_terminal=terminal)
        console.print(render_loaded(loaded))
        drawn[terminal] = console.export_text()
    pipe, terminal = drawn[False].splitlines(), drawn[True]
    header = next(line for line in pipe if line.startswith("step "))
    assert "loss scale" in header and "global grad norm" in header
    rows = pipe[pipe.index(header) + 1:pipe.index(header) + 4]
    assert [row.split()[0] for row in rows] == ["0", "1", "2"]
    assert not any(set(line) & set("┏━┃│└┡") for line in pipe) and all(len(line) <= 80 for line in pipe)
    assert "┃ step" in terminal


@pytest.mark.nonstrict_json   # it writes the old NaN/Infinity tokens on purpose, next to the strict copies
def test_the_strict_encoding_shows_what_the_old_tokens_showed(tmp_path, monkeypatch):
    lines = [json.loads(line) for line in NAN_TOKENS_LOG.read_text().splitlines()]
    for kind, write in (("old", json.dumps), ("strict", json_text)):   # json.dumps: as ampdoctor wrote before
        log = "".join(write(line) + "\n" for line in lines)
        (tmp_path / kind / "ranks").mkdir(parents=True)
        for name in ("ampdoctor.jsonl", "ranks/ampdoctor.rank0.jsonl", "ranks/ampdoctor.rank1.jsonl"):
            (tmp_path / kind / name).write_text(log)
        (tmp_path / kind / "report.json").write_text(write(lines[-1]["report"], indent=2))
    assert "NaN" in (tmp_path / "old" / "report.json").read_text()
    assert "NaN" not in (tmp_path / "strict" / "report.json").read_text().replace("inf/NaN", "")
    shown = {}
    for kind in ("old", "strict"):   # the same relative paths: the page and the console name the file
        monkeypatch.chdir(tmp_path / kind)
        loaded = [load_any(path) for path in ("ampdoctor.jsonl", "report.json", "ranks")]   # ranks: merged
        shown[kind] = [(_console(render_loaded(one)), render_html(one)) for one in loaded]
    assert shown["strict"] == shown["old"]
    console = shown["strict"][0][0].splitlines()
    header = next(i for i, line in enumerate(console) if line.startswith("step "))
    assert "global grad norm" in console[header]
    assert [line.split()[3] for line in console[header + 1:header + 3]] == ["nan", "nan"]   # steps 0 and 1
