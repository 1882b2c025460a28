"""Draw a watch's summary: the steps, the loss scale, the gradient and lost-update tables, and the verdict.

The tables fit the console's width with every name whole: numeric columns are left out first (and named), then a
name too long for its column gets the numbers on the next line. Off a terminal they are plain lines.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

from ampdoctor.core.findings import Finding
from ampdoctor.core.formats import FORMATS
from ampdoctor.core.records import AuditSection, Coverage, GradientSummary, ScaleSummary, WatchSummary
from ampdoctor.core.report import Report, verdict
from ampdoctor.core.words import counted, scale_text
from ampdoctor.ui.console import findings_table
from ampdoctor.ui.plain import Sentence

__all__ = ["render_watch", "ColumnTable"]


def render_watch(summary: WatchSummary | Mapping[str, Any], findings: list[Finding] | None) -> Any:
    """Return a rich renderable of a watch's summary (or its JSON form, ``Watch.summary_data()``) and the findings
    (None: shown elsewhere, say nothing; ``[]``: the verdict, ``core.report.verdict``).

    The tables fit the console's width with every name whole: numeric columns are left out first (and named), then
    a name too long for its column gets the numbers on the next line. Off a terminal they are plain lines.
    """
    from rich.console import Group

    if not isinstance(summary, WatchSummary):
        summary = WatchSummary.from_dict(summary)

    parts: list[Any] = [Sentence(
        f"ampdoctor watch: {counted(summary.steps, 'step')}, {summary.sampled_steps} sampled (every "
        f"{summary.every}), stats={summary.stats}, {counted(summary.host_syncs, 'host sync')}", style="bold")]
    if summary.coverage is not None:   # ampdoctor run: several optimizers step the model, the watch follows one
        parts.append(_coverage_sentence(summary.coverage))
    scale_line = _scale_line(summary.scale)
    if scale_line:
        parts.append(Sentence(scale_line))
    grads = summary.gradients
    if grads.modules:
        shown = summary.formats or tuple(f.name for f in FORMATS)   # a report of an older ampdoctor: all of them
        parts.append(_gradient_table(grads, [f for f in FORMATS if f.name in shown]))
    parts += _gradient_notes(grads)
    lost = summary.lost_updates
    if lost is not None and lost.params:
        rows = [(name, [dtype, f"{share:.0%}"])
                for name, (dtype, share) in sorted(lost.params.items(), key=lambda kv: -kv[1][1])[:20]]
        parts.append(ColumnTable("updates lost to rounding (sampled entries with a non-zero gradient left "
                                 "unchanged)", "parameter", [("dtype", 0), ("lost", 0)], rows, keep=2))
    for key, shown in summary.shown_parts():   # a part of the watch with no drawing of its own: its numbers
        parts.append(Sentence(f"{key}: " + ", ".join(f"{label} {value}" for label, value in shown)))
    parts += _audit_table(summary)
    if summary.log_path:
        parts.append(Sentence(f"flight recorder: {summary.log_path}", style="dim"))
    if findings:
        parts.append(findings_table(sorted(findings, key=lambda f: f.severity.rank), title="watch findings"))
    elif findings is not None:   # the one verdict, as the console's report closes with it
        closing = verdict(Report(extra={"watch": summary}))
        parts.append(Sentence(closing.text, style="green" if closing.kind == "ok" else "yellow"))
    return Group(*parts)


def _coverage_sentence(coverage: Coverage) -> Sentence:
    """Return which of the trainable tensors the watch followed, and how many optimizers it did not."""
    others = coverage.other_optimizers
    return Sentence(f"watched: the {coverage.tensors} of {coverage.trainable} trainable tensors that "
                    f"{coverage.optimizer} steps; {counted(others, 'other optimizer')} "
                    f"{'is' if others == 1 else 'are'} not watched", style="yellow")


def _gradient_table(grads: GradientSummary, formats: list[Any]) -> ColumnTable:
    """Return the table of the modules' gradient statistics: the 20 with the largest L2."""
    # shown left to right; left out first when the width is short: zeros, min|g|>0, the last format's u/o, ...
    columns = [("L2", 0), ("max|g|", 1), ("min|g|>0", 4 + len(formats)), ("zeros", 5 + len(formats)),
               ("inf/nan", 2), *((f"{f.name} u/o", 3 + i) for i, f in enumerate(formats))]
    rows = []
    for module, s in sorted(grads.modules.items(), key=lambda kv: -_sortable(kv[1].l2))[:20]:
        if not s.counted:  # stats="norms"
            rows.append((module, [_num(s.l2), _num(s.absmax), *["-"] * (3 + len(formats))]))
            continue
        rows.append((module, [_num(s.l2), _num(s.absmax), _num(s.min_nonzero, inf="-"), f"{s.zero_frac:.0%}",
                              str(s.nonfinite), *(f"{_pct(s.share(f.name, 'underflow'))}/"
                                                  f"{_pct(s.share(f.name, 'overflow'))}" for f in formats)]))
    top = (f", the {len(rows)} of {len(grads.modules)} modules with the largest L2"
           if len(grads.modules) > len(rows) else "")
    state = "unscaled after a clip of the still-scaled gradients: AMP408" if grads.clipped_scaled else "unscaled"
    norm = f"global norm {_num(grads.global_norm)}"
    before, after = grads.pre_clip_norm, grads.global_norm
    # read at the optimizer's step: after clip_grad_norm_ of that step, if it shrank them (a clip over nothing
    # returns 0 and shrinks nothing: AMP618)
    if before is not None and after is not None and before > after * (1 + 1e-3):
        norm += f" after clipping; {_num(before)} before" + (", still scaled" if grads.clipped_scaled else "")
    return ColumnTable(
        f"gradients at step {grads.step} ({state}; {norm}){top}",
        "module", columns, rows, keep=2, whole=4,
        notes={"u/o": "u/o: share of the sampled entries that would underflow/overflow in that format"})


# the audit's table, in every view
AUDIT_TITLE = "numerics audit: the ops farthest from fp32 on the same inputs (error: roundoff units; rounding " \
              "alone is 0.5)"
AUDIT_COLUMNS = ("line", "module", "computed in", "error")


def _audit_table(summary: WatchSummary) -> list[ColumnTable]:
    """The numerics audit's worst ops (``AuditSection.worst_rows``), when it audited any."""
    audit = summary.parts.get("audit")
    if not isinstance(audit, AuditSection) or not audit.worst:
        return []
    return [ColumnTable(AUDIT_TITLE, "op", [(header, 1 if header == "computed in" else 0) for header in AUDIT_COLUMNS],
                        audit.worst_rows(), keep=3)]


def _gradient_notes(grads: GradientSummary) -> list[Sentence]:
    """Return what the gradient table leaves out, and how many sharded parameters it merged over the ranks."""
    notes = []
    if grads.unsummarised:  # an empty or partial table says why, never nothing
        left = grads.unsummarised
        more = f"; and {len(left) - 5} more" if len(left) > 5 else ""
        notes.append(Sentence(f"left out of the gradient statistics ({len(left)}): " + "; ".join(
            f"{name}: {why}" for name, why in list(left.items())[:5]) + more, style="yellow"))
    if grads.merged_over_ranks is not None:
        merged, collectives = grads.merged_over_ranks
        notes.append(Sentence(f"{counted(merged, 'sharded parameter')} merged over their ranks "
                              f"({collectives} all-reduces so far)", style="dim"))
    return notes


def _scale_line(scale: ScaleSummary | None) -> str | None:
    """Return the loss-scale line; None when no scaler step was seen (a run that stopped first has no scale).

    >>> _scale_line(ScaleSummary()) is None
    True
    """
    if scale is None or not scale.steps or scale.current is None:
        return None
    extremes = []
    if scale.peak is not None:
        extremes.append(f"peak {scale_text(scale.peak[1])} at step {scale.peak[0]}")
    if scale.lowest is not None:
        extremes.append(f"lowest {scale_text(scale.lowest[1])}")
    return (f"loss scale {scale_text(scale.current)}" + (f" ({', '.join(extremes)})" if extremes else "") +
            f"; skipped {scale.skipped} of {scale.steps} steps ({scale.skipped_fraction:.1%}), "
            f"longest run {scale.longest_skip_run[0]}")


class ColumnTable:
    """Rows of a name and its numbers, fitted to the console's width without cutting a name or a number.

    Numeric columns with the highest rank are left out first until the numbers fit next to the longest name, down to
    ``whole``; when not even those fit, names longer than a third of the width go on lines of their own and
    columns are left out down to ``keep``. A name longer than its column gets its numbers on the next line. On a
    terminal the header is bold and underlined; elsewhere the same lines are plain, one row a line.
    """

    GAP = 2

    def __init__(self, title: str, name_header: str, columns: list[tuple[str, int]],
                 rows: list[tuple[str, list[str]]], keep: int, notes: dict[str, str] | None = None,
                 whole: int | None = None) -> None:
        self.title, self.name_header, self.columns, self.rows, self.keep = title, name_header, columns, rows, keep
        self.whole = keep if whole is None else whole  # columns worth a name kept whole on the same line
        self.notes = notes or {}  # a note is shown when its key is in a shown column's header

    def _layout(self, width: int) -> tuple[list[int], int]:
        """Return the indices of the columns shown and the width of the name column."""
        widths = [max([len(h)] + [len(values[i]) for _, values in self.rows]) for i, (h, _) in
                  enumerate(self.columns)]
        longest = max([len(self.name_header)] + [len(name) for name, _ in self.rows])
        ranks = sorted({rank for _, rank in self.columns})

        def fitting(name_width: int, floor: int) -> tuple[list[int], int]:
            shown: list[int] = []
            for limit in reversed(ranks):
                shown = [i for i, (_, rank) in enumerate(self.columns) if rank <= limit]
                if name_width + sum(widths[i] + self.GAP for i in shown) <= width or len(shown) <= floor:
                    break
            return shown, sum(widths[i] + self.GAP for i in shown)

        shown, numbers = fitting(longest, self.whole)
        if longest + numbers > width:   # not even the first `whole` columns fit next to the longest name: long
            # names (LoRA's) go on lines of their own, and the numbers get the width less a third
            shown, numbers = fitting(min(longest, max(len(self.name_header), width // 3)), self.keep)
        return shown, max(len(self.name_header), min(longest, width - numbers))

    def lines(self, width: int, terminal: bool = False) -> Iterator[Any]:
        from rich.text import Text

        shown, name_width = self._layout(width)
        widths = {i: max([len(self.columns[i][0])] + [len(v[i]) for _, v in self.rows]) for i in shown}

        def numbers(values: list[str]) -> str:
            return "".join(" " * self.GAP + values[i].rjust(widths[i]) for i in shown)

        yield Sentence(self.title, style="bold" if terminal else "")
        header = Text(self.name_header.ljust(name_width) + numbers([h for h, _ in self.columns]),
                      style="bold underline" if terminal else "")
        yield header
        for name, values in self.rows:
            if len(name) <= name_width:
                yield Text(name.ljust(name_width) + numbers(values))
            else:  # the whole name on its own line; its numbers under their headers
                yield Text(name)
                yield Text(" " * name_width + numbers(values))
        for key, note in self.notes.items():
            if any(key in self.columns[i][0] for i in shown):
                yield Sentence(note, style="dim")
        hidden = [self.columns[i][0] for i in range(len(self.columns)) if i not in shown]
        if hidden:
            yield Sentence(f"left out at {width} columns: {', '.join(hidden)}", style="dim")

    def __rich_console__(self, console: Any, options: Any) -> Iterator[Any]:
        yield from self.lines(options.max_width, console.is_terminal)


def _sortable(value: float) -> float:
    return math.inf if not math.isfinite(value) else value


def _num(value: Any, inf: str = "inf") -> str:
    """Return a statistic for the table, ``inf`` for an infinite one (for min|g|>0: no finite non-zero entry).

    >>> _num(1 / 3), _num(None), _num(math.inf), _num(math.inf, inf="-"), _num(1.234e-5)
    ('0.333', '-', 'inf', '-', '1.23e-05')
    """
    if value is None:
        return "-"
    return inf if value == math.inf else f"{value:.3g}"


def _pct(value: float) -> str:
    return "0" if not value else f"{value:.1%}" if value >= 0.001 else "<0.1%"
