"""Read what ampdoctor wrote (a JSON report or a JSON-lines flight recorder) and show it: console or HTML.

Reading uses ``json.loads`` only: nothing is unpickled or evaluated, and every value is treated as untrusted text.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.report import Report

MAX_BYTES = 512 * 1024 * 1024  # refuse to load more than this; a flight recorder of a long run stays far below


@dataclass
class Loaded:
    """A loaded file: a report, or a flight recorder's header, step records and reading problems."""

    path: str
    report: Report
    header: dict[str, Any] | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def is_log(self) -> bool:
        return self.header is not None or bool(self.records)

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.problems


def load_any(path: str) -> Loaded:
    """Load ``path``: a ``report.json`` from ``ampdoctor run --json`` or an ``ampdoctor.jsonl`` flight recorder.

    Raises:
        ValueError: the file is neither, with what was found.
        OSError: the file cannot be read.
    """
    from ampdoctor.monitor.recorder import LOG_NAME

    target = os.path.join(path, LOG_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(target):
        raise ValueError(f"no such file: {path!r}; pass a report.json or an ampdoctor.jsonl flight recorder")
    size = os.path.getsize(target)
    if size > MAX_BYTES:
        raise ValueError(f"{path!r} is {size / 2**20:.0f} MiB, more than the {MAX_BYTES // 2**20} MiB "
                         "ampdoctor reads; pass a smaller log")
    with open(target, "rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b'{"type"') or (head.startswith(b"{") and b'"type"' in head.split(b"\n", 1)[0]
                                         and b"\n" in head.strip()):
        return _load_log(path, target)
    try:
        with open(target, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path!r} is not text (not UTF-8); pass a report.json or an ampdoctor.jsonl") from None
    except RecursionError:
        raise ValueError(f"{path!r} nests JSON too deeply to be an ampdoctor report") from None
    except ValueError as exc:
        loaded = _load_log(path, target)
        if loaded.header is None and not loaded.records:
            raise ValueError(f"{path!r} is neither a JSON report nor a flight recorder ({exc})") from None
        return loaded
    if isinstance(data, dict) and data.get("type") == "header":
        return _load_log(path, target)
    return Loaded(path, Report.from_dict(data))


def _load_log(path: str, target: str) -> Loaded:
    from ampdoctor.monitor.recorder import read_log

    try:
        header, records, problems = read_log(target)
    except RecursionError:
        raise ValueError(f"{path!r} nests JSON too deeply to be an ampdoctor flight recorder") from None
    return Loaded(path, _log_report(header, records), header, records, problems)


def _log_report(header: dict[str, Any] | None, records: list[dict[str, Any]]) -> Report:
    final = next((r for r in reversed(records) if r.get("type") == "report" and isinstance(r.get("report"), dict)),
                 None)
    if final is not None:  # `ampdoctor run` appended its whole report: the same findings as its console and JSON
        try:
            return Report.from_dict(final["report"])
        except ValueError:
            pass
    end = next((r for r in reversed(records) if r.get("type") == "end"), {})
    report = Report(environment=end.get("environment") or (header or {}).get("environment") or {})
    for record in records:
        for item in record.get("findings") or []:
            finding = _finding(item)
            if finding is not None:
                report.add(finding)
    return report


def _finding(item: Any) -> Finding | None:
    try:
        return Finding(str(item["code"]), Severity(item["severity"]), str(item["where"]), str(item["detail"]),
                       item.get("step") if isinstance(item.get("step"), int) else None)
    except (KeyError, TypeError, ValueError):
        return None


# ---- series extracted from the step records --------------------------------------------------------------------
def series(loaded: Loaded) -> dict[str, list[tuple[int, float]]]:
    """Return named ``[(step, value)]`` series found in the log: loss scale, global norm, skips, underflow."""
    columns = list((loaded.header or {}).get("grad_columns") or [])
    out: dict[str, list[tuple[int, float]]] = {}

    def add(name: str, step: int, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out.setdefault(name, []).append((step, float(value)))

    for record in loaded.records:
        step = record.get("step")
        if record.get("type") != "step" or not isinstance(step, int):
            continue
        scale = record.get("scale") if isinstance(record.get("scale"), dict) else {}
        add("loss scale", step, scale.get("scale"))
        add("skipped steps (total)", step, scale.get("skipped_total"))
        grads = record.get("gradients") if isinstance(record.get("gradients"), dict) else {}
        add("global grad norm", step, grads.get("global_norm"))
        rows = grads.get("rows") if isinstance(grads.get("rows"), list) else []
        for name in ("fp16_underflow", "bf16_underflow", "e4m3_underflow", "e5m2_underflow"):
            if name in columns:
                col = columns.index(name)
                values = [r[col] for r in rows if isinstance(r, list) and len(r) > col
                          and isinstance(r[col], (int, float))]
                if values:
                    add(f"worst {name.replace('_', ' ')}", step, max(values))
        lost = record.get("lost_updates") if isinstance(record.get("lost_updates"), dict) else {}
        add("lost updates (fraction)", step, lost.get("fraction"))
    return out


def render_loaded(loaded: Loaded) -> RenderableType:
    """Return a console view: reading problems, the sampled steps, then the findings."""
    if not loaded.is_log:
        return loaded.report
    parts: list[RenderableType] = []
    header = loaded.header or {}
    steps = [r for r in loaded.records if r.get("type") == "step" and isinstance(r.get("step"), int)]
    title = f"flight recorder {loaded.path}: {len(steps)} sampled step(s)"
    if header.get("ampdoctor"):
        title += f", ampdoctor {header.get('ampdoctor')}"
    table = Table(title=title)
    data = series(loaded)
    names = [n for n in ("loss scale", "skipped steps (total)", "global grad norm", "worst fp16 underflow",
                         "lost updates (fraction)") if n in data]
    table.add_column("step", justify="right")
    for name in names:
        table.add_column(name, justify="right")
    by_step = {name: dict(values) for name, values in data.items()}
    shown = steps if len(steps) <= 20 else steps[:5] + steps[-15:]
    for index, record in enumerate(shown):
        if len(steps) > 20 and index == 5:
            table.add_row("…", *["…"] * len(names))
        step = record["step"]
        table.add_row(str(step), *[_fmt(by_step[n].get(step)) for n in names])
    parts.append(table)
    if loaded.problems:
        problems = Text("reading problems:\n", style="yellow")
        for problem in loaded.problems[:20]:
            problems.append(f"  {problem}\n")
        if len(loaded.problems) > 20:
            problems.append(f"  … and {len(loaded.problems) - 20} more\n")
        parts.append(problems)
    if steps:
        parts.append(Text(f"last completed sampled step: {steps[-1]['step']}"))
    if loaded.report.findings:
        parts.append(loaded.report)
    return Group(*parts)


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and (not math.isfinite(value) or abs(value) >= 1e4 or 0 < abs(value) < 1e-3):
        return f"{value:.3g}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ---- HTML ------------------------------------------------------------------------------------------------------
def write_html(loaded: Loaded, out: str) -> None:
    """Write a self-contained HTML report with plots (matplotlib, if installed) to ``out``.

    Every string from the file is escaped: module names such as ``<script>`` are shown, never run.
    """
    esc = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>ampdoctor report</title>{_CSS}</head><body>",
             f"<h1>ampdoctor report</h1><p class='src'>{esc(str(loaded.path))}</p>"]
    report = loaded.report
    if report.exception:
        parts.append(f"<h2>Exception</h2><pre>{esc(str(report.exception.get('type')))}: "
                     f"{esc(str(report.exception.get('message')))}</pre>")
    if report.changes:
        parts.append("<h2>Changes</h2><ul>" + "".join(f"<li>{esc(str(c))}</li>" for c in report.changes) + "</ul>")
    parts.append("<h2>Findings</h2>")
    if report.findings:
        from ampdoctor.core.catalog import get_rule

        rows = []
        for f in report.findings:
            try:
                rule = get_rule(f.code)
                title, fix = rule.title, rule.fix
            except KeyError:
                title, fix = "", ""
            rows.append(f"<tr class='{esc(f.severity.value)}'><td>{esc(f.code)}</td><td>{esc(f.severity.value)}</td>"
                        f"<td>{esc(f.where)}</td><td><b>{esc(title)}</b><br>{esc(f.detail)}"
                        f"<pre>{esc(fix)}</pre></td></tr>")
        parts.append("<table><tr><th>code</th><th>severity</th><th>where</th><th>what and fix</th></tr>"
                     + "".join(rows) + "</table>")
    else:
        parts.append("<p>No findings.</p>")
    if loaded.is_log:
        parts.append(f"<h2>Numerics over {sum(1 for r in loaded.records if r.get('type') == 'step')} sampled "
                     "steps</h2>")
        parts.extend(_plots(series(loaded)))
    if loaded.problems:
        parts.append("<h2>Reading problems</h2><ul>" + "".join(f"<li>{esc(p)}</li>" for p in loaded.problems[:200])
                     + "</ul>")
    env = report.environment or {}
    if env:
        parts.append("<h2>Environment</h2><table>" + "".join(
            f"<tr><td>{esc(str(k))}</td><td>{esc(str(v))}</td></tr>" for k, v in env.items()) + "</table>")
    parts.append("</body></html>")
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write("\n".join(parts))
    except OSError as exc:
        raise ValueError(f"cannot write {out!r}: {exc.strerror}") from None


def _plots(data: dict[str, list[tuple[int, float]]]) -> list[str]:
    if not data:
        return ["<p>No numeric series in this log.</p>"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["<p>Install matplotlib (<code>pip install 'ampdoctor[report]'</code>) for plots.</p>"]
    images = []
    for name, values in data.items():
        finite = [(s, v) for s, v in values if math.isfinite(v)]
        if not finite:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 2.6), dpi=100)
        ax.plot([s for s, _ in finite], [v for _, v in finite], marker="." if len(finite) < 50 else None)
        if name in ("loss scale", "global grad norm") and all(v > 0 for _, v in finite):
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        plt.close(fig)
        images.append(f"<figure><img alt='{html.escape(name)}' src='data:image/png;base64,"
                      f"{base64.b64encode(buf.getvalue()).decode()}'></figure>")
    return images or ["<p>All values in this log are non-finite.</p>"]


_CSS = """<style>
body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}pre{white-space:pre-wrap;margin:4px 0}
tr.error td:first-child{color:#b00}tr.warning td:first-child{color:#a60}.src{color:#666}
</style>"""
