"""One real run, every view, the same numbers: the console watch summary, ``--json``, the flight recorder,
``ampdoctor report`` on the console, the HTML page's data, the PNG figures and the TensorBoard scalars.

Each case runs ``scripts/cross_view_train.py`` under ``ampdoctor run --every 1 --json R --log-dir L`` (in-process, or
under torchrun for the 2-rank job), once per module, and then reads it back through each view. For the last sampled
step (and for every step where a view has them all) the global gradient norm, a module's fp16/bf16 underflow share,
the loss scale and the skipped-step count, and the lost-update shares must agree; printed text is compared at the
precision it is printed with.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from launch_jobs import clean_environment, free_port, run_job

from ampdoctor.core.records import Recording, read_log, read_recording, read_runs
from ampdoctor.core.words import scale_text
from ampdoctor.ui.cli import main
from ampdoctor.ui.figures import draw_figures, have_matplotlib
from ampdoctor.ui.report_files import load_any, run_data
from ampdoctor.ui.run_data import RunData

SCRIPT = Path(__file__).parent / "scripts" / "cross_view_train.py"
WIDTH = "200"  # the consoles' width: every column of the tables is shown


@dataclass
class Views:
    """One run, as each view shows it."""

    logs: Path                      # the --log-dir folder
    summary: str                    # the watch summary `ampdoctor run` printed
    report: dict[str, Any]          # --json
    recording: Recording            # the flight recorder (rank 0's in a distributed job)
    console: str                    # `ampdoctor report L`
    data: RunData                   # the HTML page's data
    figures: dict[str, Any]         # draw_figures, by key ({} without matplotlib)
    pngs: list[str]                 # the files `ampdoctor report L --png D` wrote
    scalars: dict[str, list[tuple[int, float]]]   # `ampdoctor report L --tensorboard D`, read back


def _quiet(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    return code, out.getvalue()


def _views(folder: Path, summary: str) -> Views:
    logs = folder / "logs"
    target = logs / "ampdoctor.jsonl" if (logs / "ampdoctor.jsonl").exists() else logs / "ampdoctor.rank0.jsonl"
    [run] = read_runs(target)
    assert run.problems == [], run.problems
    code, console = _quiet(["report", str(logs)])
    assert code == 0, console
    code, said = _quiet(["report", str(logs), "--png", str(folder / "png"), "--tensorboard", str(folder / "tb")])
    assert code == 0, said
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder / "tb"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    data = run_data(load_any(str(logs)))
    figures = {f.key: f.figure for f in draw_figures(data)} if have_matplotlib() else {}
    pngs = sorted(p.name for p in (folder / "png").iterdir()) if (folder / "png").exists() else []
    return Views(logs, summary, json.loads((folder / "r.json").read_text()), read_recording(run.header, run.records),
                 console, data, figures, pngs, scalars)


@pytest.fixture(scope="module")
def run_case(tmp_path_factory):
    """Return a function that runs one MODE of the script under `ampdoctor run`, in this process, once."""
    done: dict[str, Views] = {}

    def run(mode: str, *args: str) -> Views:
        if mode not in done:
            folder = tmp_path_factory.mktemp(mode)
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("COLUMNS", WIDTH)
                code, printed = _quiet(["run", "--every", "1", "--json", str(folder / "r.json"), "--log-dir",
                                        str(folder / "logs"), str(SCRIPT), mode, *args])
                assert code == 0, printed
                done[mode] = _views(folder, printed)
        return done[mode]

    return run


@pytest.fixture(scope="module")
def ddp_views(tmp_path_factory) -> Views:
    folder = tmp_path_factory.mktemp("ddp")
    env = clean_environment(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS=WIDTH,
                            AMPDOCTOR_RANK_DIR=str(folder / "exchange"))
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
              "-m", "ampdoctor", "run", "--every", "1", "--json", "r.json", "--log-dir", "logs", str(SCRIPT), "ddp"]
    code, output = run_job(launch, folder, env, timeout=180)
    assert code == 0, output[-5000:]
    assert sorted(p.name for p in (folder / "logs").iterdir()) == ["ampdoctor.rank0.jsonl", "ampdoctor.rank1.jsonl"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", WIDTH)
        return _views(folder, output)


# ---- how the views print a number ------------------------------------------------------------------------------
def g3(value: float) -> str:
    """A number as the watch summary prints it (``monitor.summary._num``)."""
    return "inf" if value == float("inf") else f"{value:.3g}"


def pct(value: float) -> str:
    """A share as the watch summary's u/o columns print it (``monitor.summary._pct``)."""
    return "0" if not value else f"{value:.1%}" if value >= 0.001 else "<0.1%"


def cell(value: float) -> str:
    """A number as `ampdoctor report` prints it in its table (``ui.report_files._fmt``)."""
    if not np.isfinite(value) or abs(value) >= 1e4 or 0 < abs(value) < 1e-3:
        return f"{value:.3g}"
    return f"{value:.4g}"


def f32(value: float) -> float:
    return float(np.float32(value))  # TensorBoard keeps float32


# ---- reading the printed text ----------------------------------------------------------------------------------
def summary_numbers(text: str) -> dict[str, Any]:
    """Return what the printed watch summary says: step, global norm, loss scale, skips, modules, lost updates."""
    head = re.search(r"gradients at step (\d+) \([^;]*; global norm (\S+?)[ )]", text)
    scale = re.search(r"loss scale (\S+?)[ ;].*?skipped (\d+) of (\d+)\s+steps", text, re.S)
    lines = text.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("module "))
    columns = re.split(r"\s{2,}", lines[top].strip())[1:]
    modules = {}
    for line in lines[top + 1:]:
        parts = line.split()
        if len(parts) != len(columns) + 1:
            break
        modules[parts[0]] = dict(zip(columns, parts[1:]))
    lost = {}
    start = next((i for i, line in enumerate(lines) if line.startswith("parameter ")), len(lines))
    for line in lines[start + 1:]:   # the table of lost updates: parameter, dtype, lost
        parts = line.split()
        if len(parts) != 3 or not parts[2].endswith("%"):
            break
        lost[parts[0]] = parts[2]
    return {"step": int(head.group(1)), "norm": head.group(2), "scale": scale and scale.group(1),
            "skipped": scale and int(scale.group(2)), "modules": modules, "lost": lost}


def report_table(text: str) -> dict[int, dict[str, str]]:
    """Return `ampdoctor report`'s table of steps, as a log gets it (plain columns): ``{step: {column: cell}}``."""
    lines = text.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("step "))
    header = re.split(r"\s{2,}", lines[top].strip())
    table = {}
    for line in lines[top + 1:]:
        cells = line.split()
        if cells[:1] == ["…"]:   # the steps left out of a long run
            continue
        if len(cells) != len(header) or not cells[0].isdigit():
            break
        table[int(cells[0])] = dict(zip(header[1:], cells[1:]))
    return table


# ---- the comparison --------------------------------------------------------------------------------------------
def assert_same_numbers(v: Views, module: str, fmt: str) -> None:
    """Every view gives the same global norm, module share, loss scale, skips and lost updates."""
    printed, table = summary_numbers(v.summary), report_table(v.console)
    step = v.recording.steps[-1].step
    assert printed["step"] == v.report["watch"]["gradients"]["step"] == step == v.data.last_step
    _same_global_norm(v, printed, table)
    _same_underflow_share(v, printed, table, module, fmt)
    _same_module_norm(v, printed, module)
    if v.report["watch"]["scale"] is not None:
        _same_loss_scale(v, printed, table)
    _same_lost_updates(v, printed, table)


def _same_global_norm(v: Views, printed: dict[str, Any], table: dict[int, dict[str, str]]) -> None:
    """The global gradient norm, at every sampled step."""
    watch, rec, data = v.report["watch"], v.recording, v.data
    norms = [(s.step, s.gradients.global_norm) for s in rec.steps]
    assert watch["gradients"]["global_norm"] == norms[-1][1] and printed["norm"] == g3(norms[-1][1])
    assert data.global_norm == norms
    assert v.scalars["ampdoctor/grad_norm"] == [(s, f32(n)) for s, n in norms]
    assert list(table) == [s for s, _ in norms]
    assert [table[s]["global grad norm"] for s, _ in norms] == [cell(n) for _, n in norms]
    if v.figures:
        [line] = [ln for ln in v.figures["grad_norms"].axes[0].lines if ln.get_label() == "global"]
        assert [tuple(p) for p in line.get_xydata()] == [(s, n) for s, n in norms if np.isfinite(n)]


def _same_underflow_share(v: Views, printed: dict[str, Any], table: dict[int, dict[str, str]], module: str,
                          fmt: str) -> None:
    """The module's underflow share in `fmt`, at every sampled step and in the summary's table (the last step)."""
    watch, rec, data = v.report["watch"], v.recording, v.data
    key = f"{fmt}_underflow"
    shares = [(s.step, s.gradients.modules()[module][key]) for s in rec.steps]
    assert watch["gradients"]["modules"][module][key] == shares[-1][1]
    assert printed["modules"][module][f"{fmt} u/o"].split("/")[0] == pct(shares[-1][1])
    assert data.cast_steps == [s for s, _ in shares] and data.cast[key][module] == [share for _, share in shares]
    worst = [(s.step, max(m[key] for m in s.gradients.modules().values())) for s in rec.steps]
    assert v.scalars[f"ampdoctor/{key}"] == [(s, f32(w)) for s, w in worst]
    assert [table[s][f"worst {fmt} underflow"] for s, _ in worst] == [cell(w) for _, w in worst]
    if v.figures:
        ax = v.figures[f"cast_{fmt}"].axes[0]
        row = [t.get_text() for t in ax.get_yticklabels()].index(module)
        assert ax.images[0].get_array()[row].tolist() == [100 * share for _, share in shares]
    assert f"cast_{fmt}.png" in v.pngs and "grad_norms.png" in v.pngs


def _same_module_norm(v: Views, printed: dict[str, Any], module: str) -> None:
    """The module's L2 norm: the summary's table, the page and TensorBoard."""
    l2 = [(s.step, s.gradients.modules()[module]["l2"]) for s in v.recording.steps]
    assert v.data.module_norms[module] == l2 and printed["modules"][module]["L2"] == g3(l2[-1][1])
    assert v.scalars[f"ampdoctor/grad_norm/{module}"] == [(s, f32(n)) for s, n in l2]


def _same_loss_scale(v: Views, printed: dict[str, Any], table: dict[int, dict[str, str]]) -> None:
    """The loss scale and the skipped steps."""
    watch, rec, data = v.report["watch"], v.recording, v.data
    last = rec.steps[-1]
    current, skipped = watch["scale"]["current"], watch["scale"]["skipped"]
    assert last.scale.scale == current and last.scale.skipped_total == skipped == len(data.skipped)
    assert printed["scale"] == scale_text(current) and printed["skipped"] == skipped
    assert data.scale[-1] == (last.scale.end, current) == (watch["scale"]["steps"], current)
    assert v.scalars["ampdoctor/loss_scale"] == [(s, f32(x)) for s, x in data.scale]
    skips = v.scalars.get("ampdoctor/skipped_steps", [])
    assert skips[-1:] == ([(data.skipped[-1], float(skipped))] if skipped else [])
    used = {s.step: _scale_used(rec, s.step) for s in rec.steps}   # the report table: the scale used at the step
    assert {s: table[s]["loss scale"] for s in used} == {s: scale_text(x) for s, x in used.items()}
    assert table[last.step]["skipped so far"] == str(skipped)
    if v.figures:
        lines = v.figures["loss_scale"].axes[0].lines
        assert [tuple(p) for p in lines[0].get_xydata()] == data.scale
        marks = [ln for ln in lines if ln.get_label().startswith("skipped step")]
        assert [ln.get_label() for ln in marks] == ([f"skipped step ({skipped})"] if skipped else [])
    assert "loss_scale.png" in v.pngs


def _same_lost_updates(v: Views, printed: dict[str, Any], table: dict[int, dict[str, str]]) -> None:
    """Lost updates: each step's pooled share, and over the run per parameter."""
    watch, rec, data = v.report["watch"], v.recording, v.data
    lost = [(s.step, s.lost.fraction) for s in rec.steps if s.lost is not None and s.lost.fraction is not None]
    assert data.lost == lost
    if not lost:
        return
    assert v.scalars["ampdoctor/lost_updates"] == [(s, f32(x)) for s, x in lost]
    assert [table[s]["lost updates (fraction)"] for s, _ in lost] == [cell(x) for _, x in lost]
    assert rec.lost_fraction() == watch["lost_updates"]["lost_fraction"]
    by_param = rec.lost_by_param()
    assert by_param == {n: p["lost_fraction"] for n, p in watch["lost_updates"]["params"].items()}
    assert printed["lost"] == {n: f"{x:.0%}" for n, x in by_param.items()}
    if v.figures:
        assert [tuple(p) for p in v.figures["lost_updates"].axes[0].lines[0].get_xydata()] == lost
    assert "lost_updates.png" in v.pngs


def _scale_used(rec: Recording, step: int) -> float:
    changes = [c for s in rec.steps if s.scale is not None for c in s.scale.changes]
    return [x for s, x in changes if s <= step][-1]


# ---- the cases -------------------------------------------------------------------------------------------------
def test_a_pure_bf16_run_with_lost_updates(run_case):
    v = run_case("bf16_lost", "5")
    assert {f["code"] for f in v.report["findings"]} >= {"AMP607"}
    assert len(v.data.lost) == 5 and all(0 < x < 1 for _, x in v.data.lost)
    assert v.data.formats == ["bf16"] and v.report["watch"]["scale"] is None
    assert_same_numbers(v, "0", "bf16")


def test_an_fp16_autocast_run_whose_gradients_underflow_at_the_loss_scale(run_case):
    v = run_case("fp16_underflow")
    assert "AMP605" in {f["code"] for f in v.report["findings"]}
    tiny = v.recording.steps[-1].gradients.params()
    # the module's share is its pooled counts, not its parameters' shares weighted by the entries examined
    assert tiny["tiny.weight"]["fp16_underflow"] > 0.5 and tiny["tiny.bias"]["fp16_underflow"] == 0.0
    assert tiny["tiny.weight"]["zero_frac"] == 0.5 and tiny["tiny.bias"]["zero_frac"] == 0.0
    assert v.report["watch"]["gradients"]["modules"]["tiny"]["fp16_underflow"] > 0.1
    assert_same_numbers(v, "tiny", "fp16")


def test_a_run_whose_first_steps_are_skipped(run_case):
    v = run_case("skips", "8")
    scale = v.report["watch"]["scale"]
    assert 0 < scale["skipped"] < 8 and scale["current"] < 2.0**22
    assert any(not np.isfinite(n) for _, n in v.data.global_norm)   # a skipped step's gradients are inf
    assert_same_numbers(v, "tiny", "fp16")
    assert_same_numbers(v, "body", "fp16")


def test_a_bf16_autocast_run_with_a_gradscaler_shows_one_set_of_formats_everywhere(run_case):
    """The run computes in bf16 and its GradScaler's loss scale is about fp16: both formats, in every view. The
    console's table showed bf16 alone (the formats were read again after the watch let go of the scaler) while the
    flight recorder, the page and AMP605 said fp16."""
    v = run_case("bf16_scaler")
    console_columns = next(line for line in v.summary.splitlines() if line.startswith("module "))
    report_columns = next(line for line in v.console.splitlines() if line.startswith("step "))
    assert v.report["watch"]["formats"] == list(v.recording.end.summary.formats) == ["fp16", "bf16"] == v.data.formats
    assert "fp16 u/o" in console_columns and "bf16 u/o" in console_columns
    assert "worst fp16 underflow" in report_columns and "worst bf16 underflow" in report_columns
    for fmt in ("fp16", "bf16"):
        assert_same_numbers(v, "tiny", fmt)


def test_a_two_rank_torchrun_job(ddp_views):
    v = ddp_views
    assert v.report["ranks"]["reported"] == [0, 1] and v.recording.header.rank == 0
    assert v.summary.count("ampdoctor watch:") == 1   # rank 0 speaks for the job
    module = next(m for m in v.report["watch"]["gradients"]["modules"] if m.endswith("tiny"))
    assert_same_numbers(v, module, "fp16")
    # DDP averages the gradients: rank 1's log has rank 0's numbers
    header, records, _ = read_log(v.logs / "ampdoctor.rank1.jsonl")
    other = read_recording(header, records)
    assert [s.gradients.global_norm for s in other.steps] == pytest.approx(
        [s.gradients.global_norm for s in v.recording.steps], rel=1e-6)

