"""Read what ampdoctor wrote (a JSON report or a JSON-lines flight recorder) and show it: console or HTML.

Reading uses ``json.loads`` only: nothing is unpickled or evaluated, and every value is treated as untrusted text.
A flight recorder's lines are read through ``ampdoctor.core.records`` (``read_recording``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ampdoctor.core.io import write_atomic
from ampdoctor.core.records import Recording, is_header, read_recording
from ampdoctor.core.report import Report
from ampdoctor.core.words import counted, scale_text
from ampdoctor.ui.plain import PlainLines, Sentence, wrap
from ampdoctor.ui.run_data import RunData, read_run

MAX_BYTES = 512 * 1024 * 1024  # refuse to load more than this; a flight recorder of a long run stays far below


@dataclass
class Loaded:
    """A loaded file: a report, or a flight recorder's run (its lines' views) and reading problems."""

    path: str
    report: Report
    run: Recording | None = None   # a flight recorder's (last) run; None for a JSON report
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # what was read and how, e.g. earlier runs in the same file
    ranks: dict[int, "Loaded"] = field(default_factory=dict)  # a folder of per-rank logs: each rank's own

    @property
    def is_log(self) -> bool:
        return self.run is not None

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.problems


def load_any(path: str) -> Loaded:
    """Load ``path``: a ``report.json`` from ``ampdoctor run --json``, an ``ampdoctor.jsonl`` flight recorder, or a
    folder holding ``ampdoctor.jsonl`` or the per-rank ``ampdoctor.rank{r}.jsonl`` files of a distributed run.

    Raises:
        ValueError: the file is neither, with what was found.
        OSError: the file cannot be read.
    """
    from ampdoctor.core.records import LOG_NAME

    if os.path.isdir(path):
        ranked = _rank_logs(path)
        if ranked:
            return _load_ranks(path, ranked)
    target = os.path.join(path, LOG_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(target):
        raise ValueError(f"no such file: {path!r}; pass a report.json, an ampdoctor.jsonl flight recorder or the "
                         "folder of a distributed run's ampdoctor.rank*.jsonl files")
    size = os.path.getsize(target)
    if size > MAX_BYTES:
        raise ValueError(f"{path!r} is {size / 2**20:.0f} MiB, more than the {MAX_BYTES // 2**20} MiB "
                         "ampdoctor reads; pass a smaller log")
    with open(target, "rb") as f:
        head = f.read(4096).lstrip()
    if _starts_like_a_log(head):
        return _load_log(path, target)
    return _load_report(path, target)


def _starts_like_a_log(head: bytes) -> bool:
    """Return whether a file's first bytes look like a flight recorder: several lines, the first a JSON object
    with a ``"type"``."""
    return head.startswith(b'{"type"') or (head.startswith(b"{") and b'"type"' in head.split(b"\n", 1)[0]
                                            and b"\n" in head.strip())


def _load_report(path: str, target: str) -> Loaded:
    """Load a JSON report; a file that is not one JSON document may still be a flight recorder."""
    try:
        with open(target, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path!r} is not text (not UTF-8); pass a report.json or an ampdoctor.jsonl") from None
    except RecursionError:
        raise ValueError(f"{path!r} nests JSON too deeply to be an ampdoctor report") from None
    except ValueError as exc:
        loaded = _load_log(path, target)
        if loaded.run is None:
            raise ValueError(f"{path!r} is neither a JSON report nor a flight recorder ({exc})") from None
        return loaded
    if is_header(data):
        return _load_log(path, target)
    return Loaded(path, Report.from_dict(data))


def _starts_with_a_header(target: str) -> bool:
    """Return whether the file begins as a flight recorder's header line does (``{"type":"header"``)."""
    try:
        with open(target, "rb") as f:
            return f.read(len(_HEADER_START)) == _HEADER_START
    except OSError:
        return False


_HEADER_START = b'{"type":"header"'


def _load_log(path: str, target: str) -> Loaded:
    from ampdoctor.core.records import read_runs

    try:
        runs = read_runs(target)
    except RecursionError:
        raise ValueError(f"{path!r} nests JSON too deeply to be an ampdoctor flight recorder") from None
    if not runs:
        return Loaded(path, Report(environment={}), None, ["empty file: no header line"])
    if all(run.header is None and not run.records for run in runs):   # not one line of ours: nothing to report on
        problems = [p for run in runs for p in run.problems]
        if _starts_with_a_header(target):   # ours, killed while it wrote its header: say so, as for an empty file
            return Loaded(path, Report(environment={}), None, problems)
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ValueError(f"{path!r} holds no ampdoctor record ({shown}); pass a report.json from `ampdoctor run "
                         "--json` or the ampdoctor.jsonl of `ampdoctor run --log-dir`")
    recordings = [read_recording(run.header, run.records) for run in runs]
    last = runs[-1]
    notes = []
    if len(runs) > 1:   # a restarted job, or the watch's next stage, appended to the same file: show its last run
        # and say where the others are; a partial line (written at detach) repeats the last sampled step
        earlier = ", ".join(f"run {i + 1} from line {run.line} "
                            f"({counted(sum(not s.partial for s in rec.steps), 'sampled step')}, "
                            f"{'ended' if rec.ended else 'no end line: stopped or killed'})"
                            for i, (run, rec) in enumerate(zip(runs[:-1], recordings)))
        notes.append(f"this file holds {len(runs)} runs (a restart or the watch's next stage appends one): "
                     f"showing the last, run {len(runs)} "
                     f"from line {last.line}; earlier: {earlier}")
    run = recordings[-1] if last.header is not None or last.records else None
    return Loaded(path, _log_report(recordings[-1]), run, last.problems, notes + recordings[-1].notes)


def _rank_logs(folder: str) -> dict[int, str]:
    from ampdoctor.core.records import rank_of_log

    found = {}
    for name in sorted(os.listdir(folder)):
        rank = rank_of_log(name)
        if rank is not None and os.path.isfile(os.path.join(folder, name)):
            found[rank] = os.path.join(folder, name)
    return found


def _load_ranks(folder: str, paths: dict[int, str]) -> Loaded:
    """Load the per-rank logs of one distributed run together: findings merged with their ranks, the lowest
    rank's steps for the tables and plots, and a line per rank saying how far it got."""
    from ampdoctor.ranks.merge import merge_rank_reports

    loaded: dict[int, Loaded] = {}
    for rank, target in sorted(paths.items()):
        size = os.path.getsize(target)
        if size > MAX_BYTES:
            raise ValueError(f"{target!r} is {size / 2**20:.0f} MiB, more than the {MAX_BYTES // 2**20} MiB "
                             "ampdoctor reads; pass a smaller log")
        loaded[rank] = _load_log(target, target)
    worlds = {one.run.header.world_size for one in loaded.values() if one.run and one.run.header}
    world = max((w for w in worlds if w is not None and 0 < w <= 1_000_000), default=None)
    expected = range(world) if world else ()
    report = merge_rank_reports({r: one.report for r, one in loaded.items()}, expected=expected)
    notes, problems = [], []
    for rank, one in loaded.items():
        state = "ended" if one.run and one.run.ended else "no end line: the process stopped or was killed mid-run"
        steps = [s.step for s in one.run.steps] if one.run else []
        last = f", last sampled step {steps[-1]}" if steps else ""
        notes.append(f"rank {rank}: {counted(len(steps), 'sampled step')}{last}; {state}")
        notes.extend(f"rank {rank}: {note}" for note in one.notes)
        problems.extend(f"rank {rank}: {p}" for p in one.problems)
    first = loaded[min(loaded)]
    return Loaded(folder, report, first.run, problems, notes, loaded)


def _log_report(run: Recording) -> Report:
    if run.report is not None:  # `ampdoctor run` appended its whole report: the same findings as its console and JSON
        try:
            return Report.from_dict(run.report)
        except ValueError:
            pass
    report = Report(environment=run.environment)
    for finding in run.findings:   # Finding.from_dict; a malformed one is left out
        report.add(finding)
    return report


def combine(log: Loaded, report: Loaded) -> Loaded:
    """Return the flight recorder ``log`` with the findings of the JSON ``report`` of the same run.

    >>> a, b = Loaded("a.jsonl", Report(), read_recording({}, [])), Loaded("r.json", Report(changes=["x"]))
    >>> combine(a, b).report.changes, combine(a, b).path
    (['x'], 'a.jsonl + r.json')
    """
    return Loaded(f"{log.path} + {report.path}", report.report, log.run, log.problems + report.problems,
                  log.notes + report.notes, log.ranks)


def run_data(loaded: Loaded) -> RunData:
    """Return the numbers the page and the figures show (``ampdoctor.ui.run_data.read_run``)."""
    return read_run(loaded.run, loaded.report.watch) if loaded.is_log or loaded.report.watch else RunData()


# ---- series extracted from the step records --------------------------------------------------------------------
def series(loaded: Loaded) -> dict[str, list[tuple[int, float]]]:
    """Return named ``[(step, value)]`` series: loss scale, skips, global norm, worst underflow, lost updates.

    Underflow is the largest per-module share of examined entries that would flush to 0 in that format.
    """
    data = run_data(loaded)
    out: dict[str, list[tuple[int, float]]] = {}
    if data.scale:
        out["loss scale"] = data.scale
        skipped = sorted(set(data.skipped))
        out["skipped steps (total)"] = [(s, float(i + 1)) for i, s in enumerate(skipped)]
    if data.global_norm:
        out["global grad norm"] = data.global_norm
    for fmt in data.formats:
        modules = data.cast.get(f"{fmt}_underflow", {})
        if modules:
            worst = [(step, max((v[i] or 0.0) for v in modules.values() if len(v) > i))
                     for i, step in enumerate(data.cast_steps)]
            out[f"worst {fmt} underflow"] = worst
    if data.lost:
        out["lost updates (fraction)"] = data.lost
    return out


def render_loaded(loaded: Loaded) -> RenderableType:
    """Return a console view: the sampled steps, reading problems, then the findings (tables only, no plots)."""
    from ampdoctor.ui.figures import INSTALL_HINT, have_matplotlib

    if not loaded.is_log and not loaded.notes:
        return loaded.report
    parts: list[RenderableType] = [Sentence(note) for note in loaded.notes]
    steps = [s.step for s in loaded.run.steps] if loaded.run is not None else []
    data = run_data(loaded)
    parts.append(_steps_table(loaded, steps, data))
    if loaded.problems:
        parts.append(_problems_text(loaded.problems))
    after = _scale_after(data)
    if after is not None:   # the scale the findings and the watch's line speak of
        parts.append(Text(f"loss scale after step {after[0] - 1}: {scale_text(after[1])}"))
    sampled = [s.step for s in loaded.run.steps if not s.partial] if loaded.run is not None else []
    if sampled:   # the scale-only line written at detach is no sampled step
        parts.append(Text(f"last completed sampled step: {sampled[-1]}"))
    if data.first_nonfinite:
        parts.append(Text(f"first inf/NaN in the forward pass: {data.first_nonfinite.module} at step "
                          f"{data.first_nonfinite.step}", style="red"))
    for key, shown in data.parts:   # a part of the watch with no drawing of its own: its numbers
        parts.append(Sentence(f"{key}: " + ", ".join(f"{label} {value}" for label, value in shown)))
    if not have_matplotlib():
        parts.append(Text(f"plots: {INSTALL_HINT}, then ampdoctor report {loaded.path} --html report.html",
                          style="dim"))
    # the findings, or the verdict of a run whose report was appended to the file (`ampdoctor run --log-dir`):
    # a flight recorder alone holds no findings, so no verdict can be read from it
    if loaded.report.findings or (loaded.run is not None and loaded.run.report is not None):
        parts.append(loaded.report)
    return Group(*parts)


def _steps_table(loaded: Loaded, steps: list[int], data: RunData) -> StepsTable:
    """Return the table of the sampled steps: the loss scale, skips and series of each; the first 5 and last 15 of
    a long run."""
    by_step = {name: dict(values) for name, values in series(loaded).items()}
    names = [n for n in ("global grad norm", "worst fp16 underflow", "worst bf16 underflow",
                         "lost updates (fraction)") if n in by_step]
    columns = ["step", *(["loss scale", "skipped so far"] if data.scale else []), *names]
    rows = []
    shown = steps if len(steps) <= 20 else steps[:5] + steps[-15:]
    for index, step in enumerate(shown):
        if len(steps) > 20 and index == 5:
            rows.append(["…"] * len(columns))
        cells = [_scale_cell(_scale_at(data.scale, step)), str(sum(s <= step for s in data.skipped))] \
            if data.scale else []
        rows.append([str(step), *cells, *[_fmt(by_step[n].get(step)) for n in names]])
    return StepsTable(_steps_title(loaded, steps), columns, rows)


class StepsTable(PlainLines):
    """The sampled steps: a rich table on a terminal, right-aligned plain columns in a pipe or a log."""

    def __init__(self, title: str, columns: list[str], rows: list[list[str]]) -> None:
        self.title, self.columns, self.rows = title, columns, rows

    def table(self, width: int) -> Table:
        table = Table(title=self.title)
        for name in self.columns:
            table.add_column(name, justify="right")
        for row in self.rows:
            table.add_row(*row)
        return table

    def lines(self, width: int) -> Iterator[Text]:
        for line in wrap(self.title, width):
            yield Text(line)
        # a log may have no step at all: the header alone
        widths = [max([len(c), *(len(r[i]) for r in self.rows)]) for i, c in enumerate(self.columns)]
        for row in [self.columns, *self.rows]:
            yield Text("  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip())


def _scale_after(data: RunData) -> tuple[int, float] | None:
    """Return ``(step, scale)`` of the scale after the run's last step (the series' last point, past every step of
    the log), or None where the log does not reach the end of the run."""
    if not data.scale or data.last_step is None or data.scale[-1][0] <= data.last_step:
        return None
    return data.scale[-1]


def _scale_cell(value: float | None) -> str:
    return "" if value is None else scale_text(value)


def _steps_title(loaded: Loaded, steps: list[int]) -> str:
    """Return the title of the steps table: the file, how many steps the run took and sampled (the watch's own
    count, as the run's console said it, where the log has its end), whose, and which ampdoctor."""
    header = loaded.run.header if loaded.run is not None else None
    end = loaded.run.end if loaded.run is not None else None
    summary = end.summary if end is not None else None
    if summary is not None and summary.steps:
        title = f"flight recorder {loaded.path}: {counted(summary.steps, 'step')}, {summary.sampled_steps} sampled"
    else:   # a log without its end: its records, less the scale-only line written at detach
        sampled = sum(not s.partial for s in loaded.run.steps) if loaded.run is not None else 0
        title = f"flight recorder {loaded.path}: {counted(sampled, 'sampled step')}"
    if loaded.ranks:
        title += f" of rank {min(loaded.ranks)} (findings: all {len(loaded.ranks)} ranks)"
    if header is not None and header.version:
        title += f", ampdoctor {header.version}"
    return title


def _problems_text(problems: list[str]) -> Text:
    """Return the reading problems, the first 20 of them."""
    text = Text("reading problems:\n", style="yellow")
    for problem in problems[:20]:
        text.append(f"  {problem}\n")
    if len(problems) > 20:
        text.append(f"  … and {len(problems) - 20} more\n")
    return text


def _scale_at(points: list[tuple[int, float]], step: int) -> float | None:
    value = None
    for s, v in points:
        if s > step:
            break
        value = v
    return value


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and (not math.isfinite(value) or abs(value) >= 1e4 or 0 < abs(value) < 1e-3):
        return f"{value:.3g}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ---- HTML ------------------------------------------------------------------------------------------------------
def render_html(loaded: Loaded) -> str:
    """Return the self-contained HTML page of ``loaded``: plots when matplotlib is installed, tables always."""
    from ampdoctor.ui.figures import INSTALL_HINT, draw_figures, have_matplotlib
    from ampdoctor.ui.html_page import render_page

    data = run_data(loaded)
    figures = draw_figures(data) if have_matplotlib() else None
    return render_page(loaded, data, figures, INSTALL_HINT)


def write_html(loaded: Loaded, out: str) -> None:
    """Write the self-contained HTML report of ``loaded`` to ``out`` (no JavaScript, no network; inline SVG).

    Every string from the file is escaped: module names such as ``<script>`` are shown, never run.

    Raises:
        ValueError: ``out`` cannot be written.
    """
    page = render_html(loaded)
    try:
        write_atomic(out, page)
    except OSError as exc:
        raise ValueError(f"cannot write {out!r}: {exc.strerror}") from None
