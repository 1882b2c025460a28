"""Rich renderables for reports, findings and the rule catalog. Data never imports this module.

Each renderable picks its layout when it is drawn, from ``console.is_terminal``: a terminal gets tables; a pipe,
``tee``, a CI log or a file (rich says "not a terminal" and draws 80 columns) gets plain lines without box
drawing, one record per line (``AMP101 error fc1: <title>``) with the details indented below it. Module names and
numbers are never cut: lines break between words only.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Sequence

from rich import box
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from ampdoctor.core.catalog import RULES, Rule, get_rule
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.grouping import FindingGroup, group_findings
from ampdoctor.core.report import missing_ranks_sentence, rank_spans, unwatched_sentence, verdict
from ampdoctor.core.words import word_for
from ampdoctor.ui.plain import INDENT, PlainLines, Sentence, wrap, wrap_code

_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}
_WHERE_ALL = "all are in the JSON report written with --json PATH"

MAX_ROWS_PER_CODE = 4  # the JSON report keeps every finding; the console shows the first few groups of each code
MAX_PLACES = 8  # places named in a group's row; the JSON report names all


class FindingsView(PlainLines):
    """The findings, one row per group (``core.grouping``): a table on a terminal, plain lines elsewhere."""

    def __init__(self, findings: Iterable[Finding], title: str, max_per_code: int) -> None:
        self.title = title
        self.rows: list[FindingGroup | tuple[str, Severity, int, list[str]]] = []
        groups = group_findings(findings)
        shown: dict[str, int] = {}
        for group in groups:
            shown[group.code] = shown.get(group.code, 0) + 1
            if shown[group.code] <= max_per_code:
                self.rows.append(group)
            elif shown[group.code] == max_per_code + 1:
                left = [g for g in groups if g.code == group.code][max_per_code:]
                # named, so that every place a table shows (a lost-updates row) is named by its finding here too
                self.rows.append((group.code, group.severity, sum(len(g.findings) for g in left),
                                  [place for g in left for place in g.places]))

    def lines(self, width: int) -> Iterator[Text]:
        yield Text(self.title, style="bold")
        for row in self.rows:
            if not isinstance(row, FindingGroup):
                code, severity, rest, places = row
                yield from _styled(wrap(f"{code} {severity.value} and {rest} more {code} "
                                        f"{word_for(rest, 'finding')} like the above, at {_some(places)} "
                                        f"({_WHERE_ALL})", width), code, severity)
                continue
            places = row.places
            # a Sequential's "3" alone reads as a number: it is said to be a module
            where = (f"module {places[0]}" if row.first.cause is not None and re.fullmatch(r"[\d.]+", places[0])
                     else places[0]) if len(places) == 1 else f"{len(places)} {_noun(row)}"
            title = _title(row.code)
            head = f"{row.code} {row.severity.value}{_step(row)} {where}" + (f": {title}" if title else "")
            yield from _styled(wrap(head, width), row.code, row.severity)
            for text in _place_lines(row.place_details) + ([f"in {row.process}"] if row.process else []) + \
                    _ranks(row) + [row.detail]:
                yield from map(Text, wrap(text, width, INDENT, INDENT))

    def table(self, width: int) -> RenderableType:
        table = Table(title=self.title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, leading=1)
        table.add_column("code", no_wrap=True)
        table.add_column("finding", overflow="fold")
        for row in self.rows:
            if not isinstance(row, FindingGroup):
                code, severity, rest, places = row
                table.add_row(Text(f"{code}\n") + Text(severity.value, style=_STYLE[severity]), Text(
                    f"and {rest} more {code} {word_for(rest, 'finding')} like the above, at {_some(places)} "
                    f"({_WHERE_ALL})", style="italic"))
                continue
            code = Text(f"{row.code}\n") + Text(row.severity.value, style=_STYLE[row.severity])
            if row.step is not None:
                code.append(f"\nstep {row.step}")
            what = Text("\n".join(_place_lines(row.place_details) or row.places), style="bold")
            if row.process:
                what.append(f"\nin {row.process}", style="italic")
            for line in _ranks(row):
                what.append(f"\n{line}", style="italic")
            if _title(row.code):
                what.append("\n" + _title(row.code), style="bold")
            what.append("\n" + row.detail)
            table.add_row(code, what)
        return table


def _some(places: list[str]) -> str:
    """Return the first ``MAX_PLACES`` places, and how many more."""
    more = len(places) - MAX_PLACES
    return ", ".join(places[:MAX_PLACES]) + (f" and {more} more" if more > 0 else "")


def _noun(group: FindingGroup) -> str:
    # a cause is shared by findings made one per module (core.grouping); other groups share a whole sentence
    return "modules" if group.first.cause is not None else "places"


def _ranks(group: FindingGroup) -> list[str]:
    """Return ``["on ranks 0, 1"]`` for findings of a distributed run, ``[]`` for one process."""
    seen = list(dict.fromkeys(f.ranks for f in group.findings if f.ranks))
    if not seen:
        return []
    ranks = sorted({r for each in seen for r in each})
    text = f"on {word_for(len(ranks), 'rank')} {rank_spans(ranks)}"
    return [text if len(seen) == 1 else f"{text} (not every place on every rank; the JSON report has each)"]


def _step(group: FindingGroup) -> str:
    return "" if group.step is None else f" (step {group.step})"


def _title(code: str) -> str:
    try:
        return get_rule(code).title
    except KeyError:
        return ""


def _place_lines(places: list[str]) -> list[str]:
    """Return the places to list: all of them when few, else the first ``MAX_PLACES`` and how many more."""
    if len(places) == 1:
        return []  # named in the row's head
    if len(places) <= MAX_PLACES + 1:
        return list(places)
    return places[:MAX_PLACES] + [f"and {len(places) - MAX_PLACES} more ({_WHERE_ALL})"]


def _styled(lines: list[str], code: str, severity: Severity | None) -> Iterator[Text]:
    """Yield the lines of a record, its code in bold and the severity after it in the severity's colour."""
    for i, line in enumerate(lines):
        text = Text(line)
        if i == 0:
            text.stylize("bold", 0, len(code))
            if severity is not None:
                text.stylize(_STYLE[severity], len(code) + 1, len(code) + 1 + len(severity.value))
        yield text


def findings_table(findings: Iterable[Finding], title: str = "ampdoctor findings",
                   max_per_code: int = MAX_ROWS_PER_CODE) -> FindingsView:
    """Return the findings, one row per group of one code and cause (at most ``max_per_code`` groups of a code).

    >>> from rich.console import Console
    >>> console = Console(width=60, color_system=None)   # not a terminal here: plain lines
    >>> console.print(findings_table([Finding("AMP104", Severity.ERROR, "optimizer[0] group 0", "eps=1e-08 is 0.")]))
    ampdoctor findings
    AMP104 error optimizer[0] group 0: Adam eps is below what
        the parameter or state dtype can represent
        eps=1e-08 is 0.
    """
    return FindingsView(findings, title, max_per_code)


class RuleView(PlainLines):
    """One rule: why it hurts, then the fix as code; a panel on a terminal, plain lines elsewhere."""

    def __init__(self, rule: Rule, severity: bool = False, fixes: Sequence[str] = ()) -> None:
        self.rule, self.severity = rule, severity
        self.fixes = list(fixes) or [rule.fix]   # several: the fixes that fit each finding, one after the other

    def lines(self, width: int) -> Iterator[Text]:
        rule = self.rule
        yield from _styled(wrap(f"{rule.code} {rule.name}: {rule.title}", width), rule.code, None)
        if self.severity:
            yield from map(Text, wrap(f"severity: {rule.severity_text()}", width, INDENT, INDENT))
        yield from map(Text, wrap(rule.why, width, INDENT, INDENT))
        for i, fix in enumerate(self.fixes):
            if i:
                yield Text("")
            yield from (Text(INDENT + line) for line in fix_lines(fix, width))

    def table(self, width: int) -> RenderableType:
        rule = self.rule
        said = [Text(f"severity: {rule.severity_text()}")] if self.severity else []
        fixes = [Syntax(fix, "python", theme="ansi_dark", word_wrap=True) for fix in self.fixes]
        body = Group(Text(rule.title, style="bold"), *said, Text(rule.why), Text(""),
                     *[part for i, fix in enumerate(fixes) for part in ([Text("")] if i else []) + [fix]])
        return Panel(body, title=f"[bold]{rule.code} {escape(rule.name)}[/]", title_align="left")


def fix_lines(fix: str, width: int) -> list[str]:
    """Return a fix as ``ampdoctor explain`` prints it in ``width`` columns, less its indent: the code whole, a
    comment too long for the line going on in comment lines under its ``#`` (the rule pages show these lines).

    >>> fix_lines("opt = AdamW(params)   # or fused=True, which adds eps in fp32", 56)
    ['opt = AdamW(params)   # or fused=True, which adds', '                      # eps in fp32']
    """
    return [line.removeprefix(INDENT) for code in fix.splitlines() for line in wrap_code(code, width)]


def fixes_panel(findings: Iterable[Finding]) -> RenderableType | None:
    """Return one panel per rule with why it hurts and the fix as code: a finding's own fix (the one that fits what
    it saw) in place of its rule's; findings of one rule with different fixes show each, under one heading."""
    fixes: dict[str, list[str | None]] = {}
    for f in findings:
        fixes.setdefault(f.code, [])
        if f.fix not in fixes[f.code]:
            fixes[f.code].append(f.fix)
    parts: list[RenderableType] = []
    for code, own in fixes.items():
        try:
            rule = get_rule(code)
        except KeyError:
            continue
        parts.append(RuleView(rule, fixes=list(dict.fromkeys(rule.fix if fix is None else fix for fix in own))))
    return Group(_FixesHeading(), *parts) if parts else None


class _FixesHeading(PlainLines):
    """A heading between the findings and the fixes in plain lines; on a terminal the panels' frames do that."""

    def lines(self, width: int) -> Iterator[Text]:
        yield Text("how to fix", style="bold")

    def table(self, width: int) -> RenderableType:
        return Group()


def rule_panel(rule: Rule, severity: bool = False) -> RuleView:
    """Return a panel explaining one rule: (its severities,) why, then the fix as code."""
    return RuleView(rule, severity)


class _Changes(PlainLines):
    """What ``--fix`` changed, one change a line (wrapped with a hanging indent), the same on any console."""

    def __init__(self, changes: list[str], shown: int = 20) -> None:
        self.changes, self.shown = changes, shown

    def lines(self, width: int) -> Iterator[Text]:
        yield Text("ampdoctor changed", style="bold")
        for change in self.changes[:self.shown]:
            yield from map(Text, wrap(change, width, "- ", "  "))
        if len(self.changes) > self.shown:
            yield from map(Text, wrap(f"and {len(self.changes) - self.shown} more (every change is in the JSON "
                                      "report written with --json PATH)", width, "  ", "  "))

    def table(self, width: int) -> RenderableType:
        return Group(*self.lines(width))


def render_report(report: Any, show_exception: bool = True) -> RenderableType:
    """Return the whole report: exception line, findings table, fixes, changes.

    ``show_exception=False`` where the traceback was just printed (``ampdoctor run``): its last line is the same.
    """
    parts: list[RenderableType] = []
    crash = report.crash
    if crash is not None and show_exception:
        rank = f"on rank {crash.rank}: " if crash.rank else ""
        parts.append(Text(f"{rank}{crash.line}", style="bold red"))
    if getattr(report, "missing_ranks", None):
        parts.append(Sentence(f"ampdoctor: {missing_ranks_sentence(report.missing_ranks)}", style="bold yellow"))
    if report.changes:
        parts.append(_Changes(list(report.changes)))
    if report.findings:
        ordered = sorted(report.findings, key=lambda f: f.severity.rank)
        parts.append(findings_table(ordered))
        panel = fixes_panel(ordered)
        if panel is not None:
            parts.append(panel)
    if getattr(report, "unwatched", None):   # with findings or without: they cover only what was seen
        parts.append(Sentence(f"ampdoctor: {unwatched_sentence(report.unwatched)}", style="bold yellow"))
    closing = verdict(report)
    if closing is not None:
        parts.append(Sentence(f"ampdoctor: {closing.text}", style="green" if closing.kind == "ok" else "bold yellow"))
    return Group(*parts)


class _RulesView(PlainLines):
    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules = list(rules)

    def lines(self, width: int) -> Iterator[Text]:
        for r in self.rules:
            yield from _styled(wrap(f"{r.code} {_severities(r)} {r.phase} {r.name}: {r.title}", width), r.code,
                               r.severity)

    def table(self, width: int) -> RenderableType:
        table = Table(title="ampdoctor rules")
        for name in ("code", "name", "severity", "phase", "title"):
            table.add_column(name, overflow="fold")
        for r in self.rules:
            table.add_row(r.code, r.name, Text(_severities(r), style=_STYLE[r.severity]), r.phase, r.title)
        return table


def _severities(rule: Rule) -> str:
    """Return the severities a rule's findings take, its own first: ``warning/error`` (explain says when)."""
    return "/".join(s.value for s in rule.severities)


def rules_table(rules: Iterable[Rule] = RULES) -> RenderableType:
    """Return the catalog: a table on a terminal, one ``code severity phase name: title`` line per rule elsewhere."""
    return _RulesView(rules)


def rules_markdown(rules: Iterable[Rule] = RULES) -> str:
    """Return the catalog as the Markdown table embedded in the README."""
    lines = ["| code | name | severity | phase | what it catches | torch/library errors it explains |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rules:
        errors = "<br>".join(_cell(error_text(p)) for p in r.errors) or "(silent)"
        lines.append(f"| {r.code} | `{r.name}` | {r.severity_text()} | {r.phase} | {r.title} | {errors} |")
    return "\n".join(lines) + "\n"


def error_text(pattern: str) -> str:
    """Return an ``errors`` pattern of a rule as the text it matches: escapes dropped, ``…`` for a word.

    >>> error_text(r"unscale_\\(\\) is being called after step\\(\\)")
    'unscale_() is being called after step()'
    """
    text = pattern.replace("\\(", "(").replace("\\)", ")").replace("\\.", ".").replace("\\S+", "…")
    text = text.replace("\\w*", "").replace("\\w+", "…").replace(" ?", " ").replace('\\"?', "")
    return text


def _cell(text: str) -> str:
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"  # code in a Markdown table cell
