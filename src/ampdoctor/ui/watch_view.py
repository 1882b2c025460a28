"""Draw a watch's summary: the steps, the loss scale, the gradient and lost-update tables, and the verdict.

The tables fit the console's width with every name whole: numeric columns are left out first (and named), then a
name too long for its column gets the numbers on the next line. Off a terminal they are plain lines.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from ampdoctor.core.findings import Finding
from ampdoctor.core.words import counted
from ampdoctor.monitor.formats import FORMATS
from ampdoctor.ui.console import findings_table
from ampdoctor.ui.plain import Sentence

__all__ = ["render_watch", "ColumnTable"]


def render_watch(data: dict[str, Any], findings: list[Finding] | None) -> Any:
    """Return a rich renderable of ``Watch.summary_data()`` and the findings (None: shown elsewhere, say nothing).

    The tables fit the console's width with every name whole: numeric columns are left out first (and named), then
    a name too long for its column gets the numbers on the next line. Off a terminal they are plain lines.
    """
    from rich.console import Group

    parts: list[Any] = [Sentence(
        f"ampdoctor watch: {counted(data['steps'], 'step')}, {data['sampled_steps']} sampled (every {data['every']}), "
        f"stats={data['stats']}, {counted(data['host_syncs'], 'host sync')}", style="bold")]
    if data.get("coverage"):   # ampdoctor run: the model is stepped by several optimizers, the watch follows one
        parts.append(_coverage_sentence(data["coverage"]))
    scale_line = _scale_line(data.get("scale"))
    if scale_line:
        parts.append(Sentence(scale_line))
    grads = data.get("gradients") or {}
    if grads.get("modules"):
        formats = [f for f in FORMATS if f.name in data.get("formats", [f.name for f in FORMATS])]
        parts.append(_gradient_table(grads, formats))
    parts += _gradient_notes(grads)
    lost = data.get("lost_updates")
    if lost and lost.get("params"):
        rows = [(name, [s["dtype"], f"{s['lost_fraction']:.0%}"])
                for name, s in sorted(lost["params"].items(), key=lambda kv: -kv[1]["lost_fraction"])[:20]]
        parts.append(ColumnTable("updates lost to rounding (sampled entries with a non-zero gradient left "
                                 "unchanged)", "parameter", [("dtype", 0), ("lost", 0)], rows, keep=2))
    if data.get("log_path"):
        parts.append(Sentence(f"flight recorder: {data['log_path']}", style="dim"))
    if findings:
        parts.append(findings_table(sorted(findings, key=lambda f: f.severity.rank), title="watch findings"))
    elif findings is not None:
        verdict, style = _verdict(data)
        parts.append(Sentence(verdict, style=style))
    return Group(*parts)


def _coverage_sentence(coverage: dict[str, Any]) -> Sentence:
    """Return which of the trainable tensors the watch followed, and how many optimizers it did not."""
    others = coverage["other_optimizers"]
    return Sentence(f"watched: the {coverage['tensors']} of {coverage['trainable']} trainable tensors that "
                    f"{coverage['optimizer']} steps; {counted(others, 'other optimizer')} "
                    f"{'is' if others == 1 else 'are'} not watched", style="yellow")


def _gradient_table(grads: dict[str, Any], formats: list[Any]) -> ColumnTable:
    """Return the table of the modules' gradient statistics: the 20 with the largest L2."""
    # shown left to right; left out first when the width is short: zeros, min|g|>0, the last format's u/o, ...
    columns = [("L2", 0), ("max|g|", 1), ("min|g|>0", 4 + len(formats)), ("zeros", 5 + len(formats)),
               ("inf/nan", 2), *((f"{f.name} u/o", 3 + i) for i, f in enumerate(formats))]
    rows = []
    for module, s in sorted(grads["modules"].items(), key=lambda kv: -_sortable(kv[1]["l2"]))[:20]:
        if "zero_frac" not in s:  # stats="norms"
            rows.append((module, [_num(s["l2"]), _num(s["absmax"]), *["-"] * (3 + len(formats))]))
            continue
        rows.append((module, [_num(s["l2"]), _num(s["absmax"]), _num(s["min_nonzero"], inf="-"),
                              f"{s['zero_frac']:.0%}", str(s["nonfinite"]),
                              *(f"{_pct(s[f.name + '_underflow'])}/{_pct(s[f.name + '_overflow'])}"
                                for f in formats)]))
    top = (f", the {len(rows)} of {len(grads['modules'])} modules with the largest L2"
           if len(grads["modules"]) > len(rows) else "")
    state = "unscaled after a clip of the still-scaled gradients: AMP408" if grads.get("clipped_scaled") \
        else "unscaled"
    norm = f"global norm {_num(grads.get('global_norm'))}"
    before, after = grads.get("pre_clip_norm"), grads.get("global_norm")
    # read at the optimizer's step: after clip_grad_norm_ of that step, if it shrank them (a clip over nothing
    # returns 0 and shrinks nothing: AMP618)
    if isinstance(before, (int, float)) and isinstance(after, (int, float)) and before > after * (1 + 1e-3):
        norm += f" after clipping; {_num(grads['pre_clip_norm'])} before" + (
            ", still scaled" if grads.get("clipped_scaled") else "")
    return ColumnTable(
        f"gradients at step {grads.get('step')} ({state}; {norm}){top}",
        "module", columns, rows, keep=2, whole=4,
        notes={"u/o": "u/o: share of the sampled entries that would underflow/overflow in that format"})


def _gradient_notes(grads: dict[str, Any]) -> list[Sentence]:
    """Return what the gradient table leaves out, and how many sharded parameters it merged over the ranks."""
    notes = []
    if grads.get("unsummarised"):  # an empty or partial table says why, never nothing
        left = grads["unsummarised"]
        more = f"; and {len(left) - 5} more" if len(left) > 5 else ""
        notes.append(Sentence(f"left out of the gradient statistics ({len(left)}): " + "; ".join(
            f"{name}: {why}" for name, why in list(left.items())[:5]) + more, style="yellow"))
    if grads.get("merged_over_ranks"):
        merged = grads["merged_over_ranks"]
        notes.append(Sentence(f"{counted(merged['params'], 'sharded parameter')} merged over their ranks "
                              f"({merged['collectives']} all-reduces so far)", style="dim"))
    return notes


def _scale_line(scale: dict[str, Any] | None) -> str | None:
    """Return the loss-scale line; None when no scaler step was seen (a run that stopped first has no scale).

    >>> _scale_line({"steps": 0, "current": None, "peak": None, "lowest": None}) is None
    True
    """
    if not scale or not scale.get("steps") or scale.get("current") is None:
        return None
    peak, lowest, run = scale.get("peak"), scale.get("lowest"), scale["longest_skip_run"]
    extremes = []
    if peak:
        extremes.append(f"peak {_num(peak['scale'])} at step {peak['step']}")
    if lowest:
        extremes.append(f"lowest {_num(lowest['scale'])}")
    return (f"loss scale {_num(scale['current'])}" + (f" ({', '.join(extremes)})" if extremes else "") +
            f"; skipped {scale['skipped']} of {scale['steps']} steps ({scale['skipped_fraction']:.1%}), "
            f"longest run {run['length']}")


def _verdict(data: dict[str, Any]) -> tuple[str, str]:
    """Return what a watch without findings may claim: nothing, unless it sampled steps and the run finished."""
    exception = data.get("exception")
    if exception:
        return (f"the run stopped with {exception.get('type')}: no verdict on its numerics", "yellow")
    if not data.get("sampled_steps"):
        return (f"no step was sampled ({counted(data['steps'], 'step')}, every {data['every']}): nothing was checked",
                "yellow")
    off = data.get("off") or []
    left_out = f" (off after an internal error: {', '.join(off)})" if off else ""
    outside = ((data.get("gradients") or {}).get("arrival") or {}).get("outside")
    if outside:   # the optimizer steps tensors of no model that ran: nothing says they train
        return (f"no numerical problems seen in {counted(data['sampled_steps'], 'sampled step')}{left_out}, but "
                f"{counted(outside, 'tensor')} the optimizer steps {'belongs' if outside == 1 else 'belong'} to no "
                "model that ran and never had a gradient: this is no all-clear", "yellow")
    return (f"no numerical problems seen in {counted(data['sampled_steps'], 'sampled step')}{left_out}", "green")




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
