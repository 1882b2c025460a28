"""One self-contained HTML page of a run: verdict, grouped findings, figures, the first inf/NaN, the environment.

No JavaScript and nothing fetched: figures are inline SVG (matplotlib, when installed), collapsible parts are
``<details>``. Every string from the file is escaped: a module named ``<script>`` is shown, never run; the
sentences' `code` spans become ``<code>`` (markdown-it, which escapes the rest). The page stays short: findings of
one rule and cause are one row (``core.grouping``, counted as the console lists them), tables and heatmaps are
capped, and a capped table says what it left out.
"""

from __future__ import annotations

import html
import math
from functools import lru_cache
from typing import Any, Iterable

from markdown_it import MarkdownIt

from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Severity
from ampdoctor.core.grouping import FindingGroup, group_findings
from ampdoctor.core.records import ActivationModule
from ampdoctor.core.report import NOTHING_OBSERVED, missing_ranks_sentence, repaired_codes, unwatched_sentence
from ampdoctor.core.report import verdict as closing_sentence
from ampdoctor.core.words import counted, scale_text, word_for
from ampdoctor.ui.run_data import RunData
from ampdoctor.ui.watch_view import AUDIT_COLUMNS, AUDIT_TITLE

__all__ = ["render_page", "verdict"]

MAX_PLACES = 8  # places listed in a findings row before the rest fold into <details>
MAX_TABLE_ROWS = 20
MAX_HEADLINES = 3  # findings named in the verdict, the most severe first; the findings table lists them all
esc = html.escape


@lru_cache(maxsize=1)
def _markdown() -> MarkdownIt:
    return MarkdownIt("zero").enable("backticks")   # code spans only: no HTML, links, emphasis or headings


def _prose(text: str) -> str:
    """Return a sentence as HTML: escaped, its `code` spans as ``<code>``.

    >>> _prose("run with `ampdoctor run --log-dir DIR` <b>")
    'run with <code>ampdoctor run --log-dir DIR</code> &lt;b&gt;'
    """
    return _markdown().renderInline(text)


def _num(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "" if value is None else esc(str(value))
    if not math.isfinite(value):
        return "inf" if value > 0 else "-inf" if value < 0 else "NaN"
    return f"{value:.3g}"


def _pct(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""
    return "0" if not value else f"{100 * value:.1f}%" if value >= 0.001 else "<0.1%"


def verdict(loaded: Any, data: RunData) -> tuple[str, list[str]]:
    """Return the verdict's class (``ok``, ``bad``, ``partial``) and its lines, as plain text: the report's closing
    sentence is the console's (``core.report.verdict``, the one verdict), an all-clear is only ``ok`` where it was
    earned, and the page is ``bad`` where the report has an error finding, a crash, or saw nothing trained. Findings
    are counted as the console lists them: one rule over several places is one (``core.grouping``).

    >>> from ampdoctor.core.report import Report
    >>> from types import SimpleNamespace
    >>> verdict(SimpleNamespace(report=Report(), problems=[]), RunData())
    ('ok', ['no mixed-precision problems found in the setup (pre-flight checks only; no training step was watched)'])
    """
    report = loaded.report
    repaired = repaired_codes(report)   # what --fix repaired stays as info; the closing sentence says it
    groups = group_findings(f for f in report.findings if f.severity is not Severity.INFO or f.code not in repaired)
    errors = sum(g.severity is Severity.ERROR for g in groups)
    warnings = sum(g.severity is Severity.WARNING for g in groups)
    lines, earned = _report_lines(loaded, groups, errors, warnings)
    lines[1:1] = [_headline(g) for g in sorted(groups, key=lambda g: g.severity.rank)
                  if g.severity is not Severity.INFO][:MAX_HEADLINES]
    if data.first_nonfinite is not None and not groups:   # a log without its report: what its records saw
        first = data.first_nonfinite
        lines.append(f"the flight recorder saw {first.kind} first in the output of {first.module}"
                     + (f" ({first.cls})" if first.cls else "") + f" at step {first.step}")
    partial = data.closed is False and not _has_report(loaded)
    if partial:
        lines.append(f"the flight recorder ends at sampled step {data.last_step} without its end line: the run was "
                     "killed or is still running; findings are those recorded so far")
    if errors or report.exception or report.saw_nothing:
        return "bad", lines
    return ("ok" if earned and not (partial or warnings) else "partial"), lines


def _headline(group: FindingGroup) -> str:
    """Return a group's line in the verdict: its code, its rule's title and where (the findings table has the rest).

    >>> from ampdoctor.core.findings import Finding
    >>> _headline(group_findings([Finding("AMP601", Severity.ERROR, "1.wo (Linear)", "inf")])[0])
    'AMP601 A module produced inf/NaN in the forward pass: 1.wo (Linear)'
    """
    try:
        title = get_rule(group.code).title
    except KeyError:
        title = group.code
    places = group.places
    more = f" and {len(places) - MAX_HEADLINES} more" if len(places) > MAX_HEADLINES else ""
    return f"{group.code} {title}: {', '.join(places[:MAX_HEADLINES])}{more}"


def _report_lines(loaded: Any, groups: list[FindingGroup], errors: int, warnings: int) -> tuple[list[str], bool]:
    """Return the verdict's lines about the report (its findings, crash, missing ranks and closing sentence), and
    whether the closing sentence is an earned all-clear."""
    report = loaded.report
    unreported = getattr(loaded, "run", None) is not None and loaded.run.header is not None and not _has_report(loaded)
    closing = None if unreported else closing_sentence(report)
    lines: list[str] = []
    if errors or warnings:
        lines.append(f"{counted(errors, 'error')}, {counted(warnings, 'warning')}")
    elif unreported:
        lines.append("no findings in this log: a watch keeps its findings in its report, not in the flight recorder "
                     "(`ampdoctor run --log-dir` appends the report to it)")
    elif groups and closing is None:   # notes alone: no error or warning, and no all-clear either
        lines.append(f"{counted(len(groups), 'finding')} at info severity, none at error or warning")
    if report.exception:
        lines.append(f"the script crashed: {report.crash.line}")
    if report.missing_ranks:
        lines.append(missing_ranks_sentence(report.missing_ranks))
    if report.unwatched:
        lines.append(unwatched_sentence(report.unwatched))
    if closing is not None:
        lines.append(closing.text)
    elif report.saw_nothing:
        lines.append(f"nothing was trained: {NOTHING_OBSERVED}")
    return lines, closing is not None and closing.kind == "ok"


def _has_report(loaded: Any) -> bool:
    run = getattr(loaded, "run", None)
    return run is not None and run.report is not None


def render_page(loaded: Any, data: RunData, figures: list[Any] | None, install_hint: str) -> str:
    """Return the page's HTML; ``figures`` None means matplotlib is missing (tables only, with ``install_hint``)."""
    report = loaded.report
    header = loaded.run.header if loaded.run is not None else None
    kind, lines = verdict(loaded, data)
    meta = [f"source {loaded.path}"]
    if header is not None and header.created:
        meta.append(f"started {header.created}")
    if data.source == "log":
        meta.append(f"{counted(data.sampled_steps, 'sampled step')}")
    if data.formats:
        meta.append("formats " + ", ".join(data.formats))
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>ampdoctor report: "
             f"{esc((lines[0] if lines else kind).replace('`', ''))}</title>{_CSS}</head><body>",
             "<h1>ampdoctor report</h1>", f"<p class='src'>{esc(' · '.join(str(m) for m in meta))}</p>",
             f"<section id='verdict' class='verdict {kind}'>"
             + "".join(f"<p>{_prose(line)}</p>" for line in lines) + "</section>"]
    if report.crash is not None and report.crash.traceback:
        parts.append(f"<details><summary>traceback</summary><pre>{esc(report.crash.traceback)}</pre></details>")
    parts.append(_findings(report.findings))
    if report.changes:
        parts.append("<h2>Changes made</h2><ul>" + "".join(f"<li>{_prose(str(c))}</li>" for c in report.changes)
                     + "</ul>")
    parts.append(_numerics(data, figures, install_hint))
    parts.append(_first_nonfinite(data))
    if loaded.problems:
        shown = loaded.problems[:50]
        parts.append("<h2>Reading problems</h2><ul>" + "".join(f"<li>{esc(p)}</li>" for p in shown)
                     + (f"<li>… and {len(loaded.problems) - 50} more</li>" if len(loaded.problems) > 50 else "")
                     + "</ul>")
    env = dict(report.environment or {}) or (loaded.run.environment if loaded.run is not None else {})
    if env:
        parts.append("<h2>Environment</h2><table id='environment'>" + "".join(
            f"<tr><td>{esc(str(k))}</td><td>{esc(str(v))}</td></tr>" for k, v in env.items()) + "</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _findings(findings: list[Any]) -> str:
    if not findings:
        return "<h2>Findings</h2><p>No findings.</p>"
    groups = sorted(group_findings(findings), key=lambda g: g.severity.rank)
    rows = [_finding_row(g) for g in groups]
    return (f"<h2>Findings</h2><table id='findings'><thead><tr><th>code</th><th>where</th>"
            f"<th>what, why and the fix</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _finding_row(group: FindingGroup) -> str:
    try:
        rule = get_rule(group.code)
        name, title, why = rule.name, rule.title, rule.why
        fix = next((f.fix for f in group.findings if f.fix), rule.fix)   # the fix that fits, if one has it
    except KeyError:
        name = title = why = fix = ""
    places = group.places
    where = "<br>".join(esc(p) for p in places[:MAX_PLACES])
    if len(places) > MAX_PLACES:
        where += (f"<details><summary>and {len(places) - MAX_PLACES} more</summary>"
                  + "<br>".join(esc(p) for p in places[MAX_PLACES:]) + "</details>")
    when = [f"step {group.step}"] if group.step is not None else []
    if group.process:
        when.append(group.process)
    ranks = sorted({r for f in group.findings for r in (f.ranks or ())})  # a torchrun job's merged report
    if ranks:
        when.append(f"on {word_for(len(ranks), 'rank')} {', '.join(map(str, ranks))}")
    return (f"<tr class='{esc(group.severity.value)}'><td><b>{esc(group.code)}</b><br>{esc(group.severity.value)}"
            f"<br><small>{esc(name)}</small></td><td class='where'>{where}</td><td><b>{_prose(title)}</b>"
            + _detail(group.detail) + (f"<p class='when'>{esc(', '.join(when))}</p>" if when else "")
            + (f"<p class='why'>{_prose(why)}</p>" if why else "") + (f"<pre>{esc(fix)}</pre>" if fix else "")
            + "</td></tr>")


def _detail(text: str) -> str:
    """Return a finding's detail: its first line as text, the rest (frame tables, op lines) preformatted."""
    first, _, rest = text.partition("\n")
    return f"<p class='detail'>{_prose(first)}</p>" + (f"<pre class='detail'>{esc(rest)}</pre>" if rest.strip() else "")


def _numerics(data: RunData, figures: list[Any] | None, install_hint: str) -> str:
    if data.source == "none":
        return "<h2>Numerics</h2><p>This report has no watch data: run with <code>ampdoctor run --log-dir DIR" \
               "</code> for a flight recorder of the loss scale, gradients and activations.</p>"
    out = ["<h2>Numerics</h2>"] + [f"<p class='note'>{_prose(n)}</p>" for n in data.notes]
    if figures is None:
        out.append(f"<p class='hint'>Tables only: plots need matplotlib, <code>{esc(install_hint)}</code>.</p>")
    else:
        for figure in figures:
            out.append(f"<figure id='fig-{esc(figure.key)}'>{figure.svg()}<figcaption>{esc(figure.caption)}"
                       "</figcaption></figure>")
    out.append(_scale_table(data))
    out.append(_gradient_table(data))
    out.append(_activation_table(data))
    out.append(_parts_table(data))
    out.append(_audit_table(data))
    return "\n".join(p for p in out if p)


def _audit_table(data: RunData) -> str:
    """The numerics audit's worst ops, as the console shows them (``AuditSection.worst_rows``)."""
    if not data.audit_worst:
        return ""
    rows = "".join(f"<tr><td>{esc(op)}</td>" + "".join(f"<td>{esc(v)}</td>" for v in values) + "</tr>"
                   for op, values in data.audit_worst)
    headers = "".join(f"<th>{esc(h)}</th>" for h in ("op", *AUDIT_COLUMNS))
    return f"<h3>{esc(AUDIT_TITLE[0].upper() + AUDIT_TITLE[1:])}</h3><table class='num' id='audit'><tr>{headers}" \
           f"</tr>{rows}</table>"


def _parts_table(data: RunData) -> str:
    """The numbers of the watch's parts that have no drawing of their own (``WatchSummary.shown_parts``)."""
    if not data.parts:
        return ""
    rows = "".join(f"<tr><td>{esc(key)}</td><td>{esc(label)}</td><td>{esc(value)}</td></tr>"
                   for key, shown in data.parts for label, value in shown)
    return f"<h3>Other parts of the watch</h3><table class='num' id='parts'><tr><th>part</th><th>number</th>" \
           f"<th>value</th></tr>{rows}</table>"


def _scale_table(data: RunData) -> str:
    """The loss scale, one row per change with the steps that used it; a long history's first 5 and last 15 rows,
    with a row that says how many were left out between them (and one for the steps before the record begins)."""
    if not data.scale:
        return ""
    rows = [f"<tr><td>{esc(span)}</td><td>{scale_text(scale)}</td></tr>" for span, scale in _scale_spans(data)]
    if len(rows) > MAX_TABLE_ROWS:
        left_out, following = data.scale[5:-15], data.scale[-15][0]
        rows[5:-15] = [f"<tr class='gap'><td colspan='2'>… {counted(len(left_out), 'change')} of the scale in steps "
                       f"{left_out[0][0]}–{following - 1} not shown</td></tr>"]
    if data.scale[0][0] > 0:   # a summary keeps the last 200 changes; a watch attached mid-run saw none before
        rows.insert(0, f"<tr class='gap'><td colspan='2'>… steps 0–{data.scale[0][0] - 1}: not in this record"
                       "</td></tr>")
    skipped = data.skipped[:40]
    return ("<h3>Loss scale</h3><table class='num' id='loss-scale'><tr><th>steps</th><th>scale</th></tr>"
            + "".join(rows) + "</table>"
            + f"<p>{counted(len(data.skipped), 'skipped step')}"
            + (": " + ", ".join(map(str, skipped)) + (" …" if len(data.skipped) > 40 else "") if skipped else "")
            + "</p>")


def _scale_spans(data: RunData) -> list[tuple[str, float]]:
    """Return ``(the steps that used a scale, the scale)`` per change: ``10–49``, and the scale after the run's
    last step (``after step 59``) when the history ends with it."""
    last = data.steps - 1 if data.steps else data.last_step
    spans = []
    for (start, scale), (following, _) in zip(data.scale, data.scale[1:] + [(None, None)]):
        end = following - 1 if following is not None else last
        if end is None:
            spans.append((f"{start}–", scale))
        elif start > end:
            spans.append((f"after step {end}", scale))
        else:
            spans.append((f"{start}" if start == end else f"{start}–{end}", scale))
    return spans


def _last(values: Iterable[Any]) -> Any:
    return next((v for v in reversed(list(values)) if v is not None), None)


def _gradient_table(data: RunData) -> str:
    if not data.module_norms:
        return ""
    kinds = [f"{f}_{k}" for f in data.formats for k in ("underflow", "overflow") if f"{f}_{k}" in data.cast]
    if "nonfinite" in data.cast:
        kinds.append("nonfinite")
    step = data.cast_steps[-1] if data.cast_steps else None

    def worst(module: str) -> float:
        shares = [_last(data.cast[k].get(module, [])) or 0.0 for k in kinds]
        norm = data.module_norms[module][-1][1]
        return max(shares, default=0.0) * 1e6 + (norm if math.isfinite(norm) else 1e5)

    modules = sorted(data.module_norms, key=lambda m: -worst(m))
    head = "".join(f"<th>{esc(k.replace('_', ' ').replace('nonfinite', 'inf/NaN'))}</th>" for k in kinds)
    rows = "".join(f"<tr><td>{esc(m)}</td><td>{_num(data.module_norms[m][-1][1])}</td>"
                   + "".join(f"<td>{_pct(_last(data.cast[k].get(m, [])))}</td>" for k in kinds) + "</tr>"
                   for m in modules[:MAX_TABLE_ROWS])
    more = f"<p>… and {len(modules) - MAX_TABLE_ROWS} more modules</p>" if len(modules) > MAX_TABLE_ROWS else ""
    return (f"<h3>Gradients per module at step {step}</h3><p class='note'>L2 norm of the unscaled gradient; "
            "underflow/overflow: share of the finite non-zero entries examined that the format would flush to 0 "
            "or turn to inf; inf/NaN: share of all entries.</p>"
            f"<table class='num' id='gradients'><tr><th>module</th><th>L2</th>{head}</tr>{rows}</table>{more}")


def _activation_table(data: RunData) -> str:
    modules = {m: s for m, s in data.activation_modules.items() if m != "(root)"}
    if not modules:
        return ""

    def order(item: tuple[str, ActivationModule]) -> float:
        s = item[1]
        return -(2.0 if s.nonfinite_forward_steps else s.headroom_ratio or 0.0)

    rows = "".join(
        f"<tr{' class=bad' if s.nonfinite_forward_steps else ''}><td>{esc(m)}</td>"
        f"<td>{esc(s.cls or '')}</td><td>{_num(s.max_abs)}</td><td>{_num(s.limit)}</td>"
        f"<td>{_pct(s.headroom_ratio)}</td><td>{_num(s.nonfinite_forward_steps)}</td>"
        f"<td>{_num(s.nonfinite_backward_steps)}</td></tr>"
        for m, s in sorted(modules.items(), key=order)[:MAX_TABLE_ROWS])
    return ("<h3>Activation headroom</h3><table class='num' id='activations'><tr><th>module</th><th>class</th>"
            "<th>max |output|</th><th>dtype max</th><th>used</th><th>steps with inf/NaN output</th>"
            f"<th>steps with inf/NaN gradient</th></tr>{rows}</table>")


def _first_nonfinite(data: RunData) -> str:
    first = data.first_nonfinite
    if not first:
        back = data.first_nonfinite_backward
        if back:
            return (f"<h2>First non-finite gradient</h2><p>{esc(str(back.kind))} in the gradient of "
                    f"<b>{esc(str(back.module))}</b> ({esc(str(back.cls))}) at step "
                    f"{esc(str(back.step))}, with a finite forward pass.</p>")
        return ""
    out = [f"<h2>First non-finite forward</h2><p id='first-nonfinite'>{esc(str(first.kind))} in the output of "
           f"<b>{esc(str(first.module))}</b>" + (f" ({esc(first.cls)})" if first.cls else "")
           + f" at step {esc(str(first.step))}: the first module, in call order, whose output is not finite."
           + "</p>"]
    op = first.op
    if op:
        out.append(f"<p>op <code>{esc(op.op)}</code> made {esc(op.kind)} from finite inputs; "
                   f"call path {esc(' → '.join(op.module_stack))}</p><table class='num'><tr><th>tensor</th>"
                   "<th>dtype</th><th>shape</th><th>abs max</th></tr>" + "".join(
                       f"<tr><td>{esc(t.role)}</td><td>{esc(t.dtype)}</td><td>{esc(str(list(t.shape)))}</td>"
                       f"<td>{_num(t.abs_max)}</td></tr>" for t in op.tensors[:12]) + "</table>")
    frames = first.frames
    if frames:
        rows = []
        for frame in frames[-8:]:
            for role, lo, hi in frame.rows[:12]:
                bad = hi is not None and not math.isfinite(hi)
                rows.append(f"<tr{' class=bad' if bad else ''}><td>{esc(frame.module)}</td>"
                            f"<td>{esc(frame.cls)}</td><td>{esc(role)}</td>"
                            f"<td>{_num(lo)}</td><td>{_num(hi)}</td></tr>")
        out.append("<h3>Frames: the modules that ran last, in call order</h3><table class='num' id='frames'><tr>"
                   "<th>module</th><th>class</th><th>tensor</th><th>abs min (non-zero)</th><th>abs max</th></tr>"
                   + "".join(rows) + "</table>")
    elif data.source == "log":
        out.append("<p class='note'>No frames recorded for this event (the activation monitor re-runs the forward "
                   "to dump them when it watches that step).</p>")
    return "\n".join(out)


_CSS = """<style>
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1100px;padding:0 1em;color:#222}
h1{margin-bottom:0}h2{margin-top:1.6em;border-bottom:1px solid #ddd}.src{color:#666;margin-top:.2em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;vertical-align:top;
text-align:left}table.num td{font-variant-numeric:tabular-nums}pre{white-space:pre-wrap;margin:4px 0;
background:#f6f6f6;padding:4px}.verdict{padding:.6em 1em;border-radius:6px;font-size:1.1em}
.verdict p{margin:.25em 0}.verdict.ok{background:#e8f5e9}.verdict.bad{background:#ffebee}
.verdict.partial{background:#fff8e1}tr.error td:first-child{color:#b71c1c}tr.warning td:first-child{color:#e65100}
tr.bad td{background:#ffebee}tr.gap td{color:#666;font-style:italic}
td.where{min-width:7em;max-width:22em;overflow-wrap:anywhere}
.why{color:#444}.note,.when{color:#666}.hint{background:#fff8e1;padding:.4em}
figure{margin:1em 0}figure svg{max-width:100%;height:auto}
figcaption{color:#555;font-size:.9em}
</style>"""
