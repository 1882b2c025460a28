"""Rich renderables for reports, findings and the rule catalog. Data never imports this module."""

from __future__ import annotations

from typing import Any, Iterable

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from ampdoctor.core.catalog import RULES, Rule, get_rule
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.report import NOTHING_OBSERVED

_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


MAX_ROWS_PER_CODE = 4  # the JSON report keeps every finding; the console shows the first few of each code


def findings_table(findings: Iterable[Finding], title: str = "ampdoctor findings",
                   max_per_code: int = MAX_ROWS_PER_CODE) -> Table:
    """Return a table with one row per finding (at most ``max_per_code`` rows of one code, then a count)."""
    table = Table(title=title, show_lines=True, expand=False)
    table.add_column("code", no_wrap=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("where", overflow="fold")
    table.add_column("what", overflow="fold")
    findings = list(findings)
    shown: dict[str, int] = {}
    for f in findings:
        shown[f.code] = shown.get(f.code, 0) + 1
        if shown[f.code] > max_per_code:
            if shown[f.code] == max_per_code + 1:
                rest = sum(1 for g in findings if g.code == f.code) - max_per_code
                table.add_row(f.code, Text(f.severity.value, style=_STYLE[f.severity]), Text("…"),
                              Text(f"and {rest} more {f.code} finding(s) like the above (all are in the JSON "
                                   "report written with --json PATH)", style="italic"))
            continue
        try:
            title_text = get_rule(f.code).title
        except KeyError:
            title_text = ""
        what = Text(title_text + "\n", style="bold") if title_text else Text()
        what.append(f.detail)
        step = "" if f.step is None else f" (step {f.step})"
        where = Text(f.where)
        if f.process is not None:
            where.append(f"\nin {f.process}", style="italic")
        table.add_row(f.code, Text(f.severity.value + step, style=_STYLE[f.severity]), where, what)
    return table


def fixes_panel(findings: Iterable[Finding]) -> RenderableType | None:
    """Return one panel per distinct rule with why it hurts and the fix as code."""
    parts: list[RenderableType] = []
    for code in dict.fromkeys(f.code for f in findings):
        try:
            rule = get_rule(code)
        except KeyError:
            continue
        parts.append(rule_panel(rule))
    return Group(*parts) if parts else None


def rule_panel(rule: Rule) -> Panel:
    """Return a panel explaining one rule: why, then the fix as code."""
    body = Group(Text(rule.why), Text(""), Syntax(rule.fix, "python", theme="ansi_dark", word_wrap=True))
    return Panel(body, title=f"[bold]{rule.code} {escape(rule.name)}[/]: {escape(rule.title)}", title_align="left")


def render_report(report: Any, show_exception: bool = True) -> RenderableType:
    """Return the whole report: exception line, findings table, fixes, changes.

    ``show_exception=False`` where the traceback was just printed (``ampdoctor run``): its last line is the same.
    """
    parts: list[RenderableType] = []
    if report.exception and show_exception:
        parts.append(Text(f"{report.exception.get('type')}: {report.exception.get('message')}", style="bold red"))
    if report.changes:
        changes = Table(title="ampdoctor changed", show_header=False)
        changes.add_column("change", overflow="fold")
        for change in report.changes[:20]:
            changes.add_row(Text(str(change)))
        if len(report.changes) > 20:
            changes.add_row(Text(f"… and {len(report.changes) - 20} more (every change is in the JSON report: --json PATH)", style="italic"))
        parts.append(changes)
    if report.findings:
        ordered = sorted(report.findings, key=lambda f: f.severity.rank)
        parts.append(findings_table(ordered))
        panel = fixes_panel(ordered)
        if panel is not None:
            parts.append(panel)
    elif getattr(report, "saw_nothing", False):
        parts.append(Text(f"ampdoctor: {NOTHING_OBSERVED}. If the training runs in another process, run it "
                          "under ampdoctor too; `ampdoctor run` follows Python child processes it starts.",
                          style="bold yellow"))
    elif not report.exception:
        parts.append(Text("ampdoctor: no mixed-precision problems found", style="green"))
    return Group(*parts)


def rules_table(rules: Iterable[Rule] = RULES) -> Table:
    """Return the catalog as a table."""
    table = Table(title="ampdoctor rules")
    for name in ("code", "name", "severity", "phase", "title"):
        table.add_column(name, overflow="fold")
    for r in rules:
        table.add_row(r.code, r.name, Text(r.severity.value, style=_STYLE[r.severity]), r.phase, r.title)
    return table


def rules_markdown(rules: Iterable[Rule] = RULES) -> str:
    """Return the catalog as the Markdown table embedded in the README."""
    lines = ["| code | name | severity | phase | what it catches | torch/library errors it explains |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rules:
        errors = "<br>".join(f"`{_plain(p)}`" for p in r.errors) or "(silent)"
        lines.append(f"| {r.code} | `{r.name}` | {r.severity.value} | {r.phase} | {r.title} | {errors} |")
    return "\n".join(lines) + "\n"


def _plain(pattern: str) -> str:
    # Show a regex as the text it matches: drop escapes, keep it readable.
    text = pattern.replace("\\(", "(").replace("\\)", ")").replace("\\.", ".").replace("\\S+", "…")
    text = text.replace("\\w*", "").replace("\\w+", "…").replace(" ?", " ").replace('\\"?', "")
    return text.replace("|", "\\|").replace("`", "'")
