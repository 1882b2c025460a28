"""The report's figures, drawn with matplotlib when it is installed (the ``report`` extra), as SVG or PNG.

matplotlib is imported here and only when a figure is drawn; ``have_matplotlib()`` says whether it can be. Every
figure is a ``matplotlib.figure.Figure`` made without pyplot (no global state, no GUI backend). Names from the
file (modules) go in as plain text: a ``$`` is escaped so that no mathtext is parsed, and the SVG writer escapes
markup.
"""

from __future__ import annotations

import io
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator

from ampdoctor.monitor.numerics import GRADED_ULPS
from ampdoctor.ui.run_data import RunData, read_run

__all__ = ["Figure", "have_matplotlib", "draw_figures", "write_pngs", "INSTALL_HINT"]

INSTALL_HINT = "pip install matplotlib"
MAX_HEATMAP_ROWS = 30  # modules shown in a heatmap: the ones with the largest shares; the rest are counted
MAX_NORM_LINES = 8  # per-module gradient norm lines besides the global norm
PERCENT_TICKS = (0, 0.1, 1, 10, 100)  # the heatmaps' colour bar, in % of entries
HEADROOM_IN_REACH = 1e-6  # a largest activation / dtype max from here on is drawn with the overflow line (1)
_RC = {"svg.fonttype": "none", "font.size": 9, "axes.titlesize": 10, "svg.hashsalt": "ampdoctor"}
# svg.fonttype none: text stays text in the SVG (searchable, small); hashsalt: the same SVG ids on every run
_BAD = "#c62828"


@dataclass(frozen=True)
class Figure:
    """One drawn figure: a file-name-safe key, a caption, and the figure's SVG and PNG writers."""

    key: str
    caption: str
    figure: Any

    def svg(self) -> str:
        """Return the figure as an inline ``<svg>`` element (no XML prolog)."""
        import matplotlib

        buf = io.StringIO()
        with matplotlib.rc_context(_RC):
            self.figure.savefig(buf, format="svg", metadata={"Date": None})
        text = buf.getvalue()
        return re.sub(r"<metadata>.*?</metadata>\s*", "", text[text.index("<svg"):], flags=re.S)

    def png(self, path: str) -> None:
        self.figure.savefig(path, format="png", dpi=110)


def have_matplotlib() -> bool:
    """Return whether matplotlib can be imported (``pip install matplotlib``, or the ``report`` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _short(name: str, width: int = 44) -> str:
    """Return a module name for a label: its tail when long, ``$`` escaped (matplotlib reads $…$ as math)."""
    name = name if len(name) <= width else "…" + name[-(width - 1):]
    return name.replace("$", r"\$")


def draw_figures(data: RunData) -> list[Figure]:
    """Return the figures for ``data``, in page order; an empty list when there is nothing to plot.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib
    from matplotlib.figure import Figure as MplFigure

    out: list[Figure] = []
    with matplotlib.rc_context(_RC):
        for key, caption, draw in _plans(data):
            fig = MplFigure(figsize=(9, 3.2), layout="constrained")
            if draw(fig) is not False:
                out.append(Figure(key, caption, fig))
    return out


def _plans(data: RunData) -> Iterator[tuple[str, str, Any]]:
    if data.loss:
        yield "loss", "Loss at each sampled step (the last loss given to backward, divided by the GradScaler's " \
                      "scale); red ▲: inf/NaN", lambda fig: _loss(fig, data)
    if data.scale:
        yield "loss_scale", "Loss scale over steps; red ×: a skipped step (inf/NaN gradients)", \
            lambda fig: _loss_scale(fig, data)
    if len(data.global_norm) > 1 or any(len(v) > 1 for v in data.module_norms.values()):
        yield "grad_norms", "Unscaled gradient L2 norms over sampled steps: the global norm and the largest " \
                            "modules; red ▲: inf/NaN", lambda fig: _norms(fig, data)
    for fmt in data.formats:
        kinds = [k for k in ("underflow", "overflow") if f"{fmt}_{k}" in data.cast]
        if kinds and len(data.cast_steps) > 1:  # one step (a report alone): the table shows it
            yield f"cast_{fmt}", f"Gradient entries that would underflow to 0 / overflow to inf in {fmt}, per " \
                                 "module and sampled step (% of the finite non-zero entries examined)", \
                lambda fig, fmt=fmt, kinds=kinds: _heatmaps(fig, data, [(f"{fmt} {k}", f"{fmt}_{k}") for k in kinds])
    nonfinite = data.cast["nonfinite"].values() if "nonfinite" in data.cast else []
    if len(data.cast_steps) > 1 and any(any(v for v in values if v) for values in nonfinite):
        yield "nonfinite_grads", "Gradient entries that are inf/NaN, per module and sampled step (% of all entries)", \
            lambda fig: _heatmaps(fig, data, [("inf/NaN gradients", "nonfinite")])
    if len(data.activations) > 1:
        yield "activations", "Activation headroom at the sampled steps (dots) of the run: the largest activation " \
                             "over the largest value its dtype holds (1 = overflow); red ×: an inf/NaN forward", \
            lambda fig: _activations(fig, data)
    elif data.activation_modules:
        # one step looked at (a step after trouble, a run that stopped at once): per module, not a one-point line
        steps = ", ".join(str(a.step) for a in data.activations)
        yield "activations", f"Activation headroom per module{f' at step {steps}' if steps else ''}: the largest " \
                             "activation over the largest value its dtype holds (1 = overflow); red: an inf/NaN " \
                             "output", lambda fig: _activations(fig, data)
    if data.lost:
        yield "lost_updates", "Updates lost to rounding (share of sampled entries with a gradient left " \
                              "unchanged)", lambda fig: _lost(fig, data)
    yield from _audit_plans(data)


def _audit_plans(data: RunData) -> Iterator[tuple[str, str, Any]]:
    if data.audit_modules:
        yield "audit", "Numerics audit: per module, the largest error of its fp16/bf16 ops (and of a leaf module's " \
                       "output) against fp32 on the same inputs, in units of the format's roundoff (rounding alone " \
                       f"costs 0.5; dashed: {GRADED_ULPS:g}, where AMP705 starts)", lambda fig: _audit(fig, data)


def _audit(fig: Any, data: RunData) -> Any:
    ax = fig.add_subplot()
    rows = sorted(data.audit_modules, key=lambda mu: -mu[1])[:20]
    ulps = [max(u, 1e-3) for _, u in rows]
    ax.barh([_short(m) for m, _ in rows], ulps, color=[_BAD if u >= GRADED_ULPS else "#2e7d32" for u in ulps])
    ax.invert_yaxis()
    fig.set_size_inches(9, 1.2 + 0.22 * len(rows))
    ax.axvline(GRADED_ULPS, color=_BAD, lw=1, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("largest error, roundoff units")
    ax.grid(alpha=0.3)
    return None


def _scale_at(points: list[tuple[int, float]], step: int) -> float:
    value = points[0][1]
    for s, v in points:
        if s > step:
            break
        value = v
    return value


def _loss_scale(fig: Any, data: RunData) -> None:
    ax = fig.add_subplot()
    steps, values = zip(*data.scale)
    ax.step(steps, values, where="post", color="#1565c0", label="loss scale")
    if data.skipped:
        ax.plot(data.skipped, [_scale_at(data.scale, s) for s in data.skipped], "x", color=_BAD, ms=7,
                label=f"skipped step ({len(data.skipped)})")
    if all(v > 0 for v in values):
        ax.set_yscale("log", base=2)
    first, last = data.scale[0][1], data.scale[-1][1]
    if last < first / 16:
        ax.set_title(f"loss scale fell from {first:g} to {last:g}", color=_BAD)
    _run_range(ax, data)
    ax.set_ylabel("loss scale")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")


def _run_range(ax: Any, data: RunData) -> None:
    """Label the x axis as steps and show the run's whole step range on it, so that the sampled points sit where
    they were in the run (steps 0-9 and 50 of a 150-step run are not its whole story)."""
    last = max((data.steps or 0) - 1, data.last_step or 0)
    low, high = ax.get_xlim()
    pad = max(0.5, 0.02 * last)
    ax.set_xlim(min(low, -pad), max(high, last + pad))
    ax.set_xlabel("step")


def _loss(fig: Any, data: RunData) -> None:
    ax = fig.add_subplot()
    finite = [(s, v) for s, v in data.loss if math.isfinite(v)]
    if finite:
        ax.plot(*zip(*finite), color="#6a1b9a", marker="." if len(finite) < 60 else None, label="loss")
        values = [v for _, v in finite]
        if min(values) > 0 and max(values) > 100 * min(values):   # spans two decades: a log axis keeps the tail
            ax.set_yscale("log")
    _mark_nonfinite(ax, [s for s, v in data.loss if not math.isfinite(v)], "inf/NaN loss")
    if not finite:
        fig.set_size_inches(9, 1.5)
        ax.set_yticks([])
        ax.text(0.5, 0.4, "every sampled loss is inf/NaN", transform=ax.transAxes, ha="center", color=_BAD)
    _run_range(ax, data)
    ax.set_ylabel("loss" if finite else "")
    ax.grid(alpha=0.3)
    if finite and len(ax.get_legend_handles_labels()[0]) > 1:   # the loss and the inf/NaN marks
        ax.legend(loc="best", fontsize=8)


def _mark_nonfinite(ax: Any, steps: list[int], label: str) -> None:
    if steps:
        ax.plot(steps, [0.97] * len(steps), "^", color=_BAD, ms=6, transform=ax.get_xaxis_transform(),
                clip_on=False, label=label)


def _norms(fig: Any, data: RunData) -> None:
    ax = fig.add_subplot()
    finite_total = [(s, v) for s, v in data.global_norm if math.isfinite(v)]
    if finite_total:
        ax.plot(*zip(*finite_total), color="black", lw=2, marker="." if len(finite_total) < 60 else None,
                label="global")
    _mark_nonfinite(ax, [s for s, v in data.global_norm if not math.isfinite(v)], "global: inf/NaN")
    peak = {m: max((v for _, v in s if math.isfinite(v)), default=-1.0) for m, s in data.module_norms.items()}
    top = sorted((m for m in peak if peak[m] > 0), key=lambda m: -peak[m])[:MAX_NORM_LINES]
    for module in top:
        points = [(s, v) for s, v in data.module_norms[module] if math.isfinite(v)]
        ax.plot(*zip(*points), lw=1, marker="." if len(points) < 60 else None, label=_short(module, 32))
    positive = [v for _, v in finite_total] + [v for m in top for _, v in data.module_norms[m]]
    if positive and all(v > 0 for v in positive if math.isfinite(v)):
        ax.set_yscale("log")
    if not finite_total and not top:  # nothing to draw but the marks: a short strip
        fig.set_size_inches(9, 1.5)
        ax.set_yticks([])
        ax.text(0.5, 0.4, "every sampled gradient norm is inf/NaN", transform=ax.transAxes, ha="center",
                color=_BAD)
    _run_range(ax, data)
    ax.set_ylabel("L2 norm (unscaled)" if finite_total or top else "")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)


def _heatmaps(fig: Any, data: RunData, panels: list[tuple[str, str]]) -> None:
    import numpy as np
    from matplotlib.colors import SymLogNorm

    modules: list[str] = []
    for _, key in panels:
        modules += [m for m in data.cast[key] if m not in modules]
    worst = {m: max((v or 0.0 for _, key in panels for v in data.cast[key].get(m, [])), default=0.0)
             for m in modules}
    shown = sorted(sorted(modules, key=lambda m: -worst[m])[:MAX_HEATMAP_ROWS], key=modules.index)
    fig.set_size_inches(9, 1.2 + 0.22 * len(shown))
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    steps = data.cast_steps
    gaps = _gaps(steps)
    ticks = _column_ticks(steps, gaps)
    for ax, (title, key) in zip(axes, panels):
        grid = np.full((len(shown), len(steps)), np.nan)
        for row, module in enumerate(shown):
            values = data.cast[key].get(module, [])
            for col, value in enumerate(values[:len(steps)]):
                if value is not None:
                    grid[row, col] = 100.0 * value
        # every panel in one unit, 0-100%: linear to 0.1%, logarithmic above, so 0.5% shows as well as 100% does
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma_r",
                          norm=SymLogNorm(linthresh=0.1, linscale=0.5, vmin=0.0, vmax=100.0, base=10),
                          extent=(-0.5, len(steps) - 0.5, len(shown) - 0.5, -0.5))
        ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
        for col in gaps:   # the columns are sampled steps: mark where the steps between them were left out
            ax.axvline(col - 0.5, color="#1565c0", lw=1.2, ls=(0, (3, 2)))
        ax.set_yticks(range(len(shown)), [_short(m) for m in shown])
        ax.set_xlabel("sampled step" + ("; dashed: steps not sampled" if gaps else ""))
        ax.set_title(title if np.nanmax(grid, initial=0.0) > 0 else f"{title}: none")
        bar = fig.colorbar(image, ax=ax, label="% of entries", shrink=0.9, ticks=PERCENT_TICKS)
        bar.ax.set_yticklabels([f"{t:g}" for t in PERCENT_TICKS])
    hidden = len(modules) - len(shown)
    if hidden:
        fig.suptitle(f"{len(shown)} of {len(modules)} modules: the {hidden} not shown stay below "
                     f"{100 * max((worst[m] for m in modules if m not in shown), default=0.0):.2g}%", fontsize=9)


def _gaps(steps: list[int]) -> list[int]:
    """Return the columns of ``steps`` before which more steps were left out than between the closest columns
    (steps 0-9, then every 50th: the columns of 50 and 100; every 50th alone: none, its labels say so).

    >>> _gaps([0, 1, 2, 50, 100]), _gaps([0, 50, 100, 149]), _gaps([3])
    ([3, 4], [], [])
    """
    apart = [b - a for a, b in zip(steps, steps[1:])]
    closest = min(apart, default=0)
    return [col + 1 for col, d in enumerate(apart) if d > 1.5 * closest]


def _column_ticks(steps: list[int], gaps: list[int]) -> list[int]:
    """Return the columns to label: every one where they fit (12 in a panel), else the first, those after a gap
    and the last first, then evenly spaced ones, each at least a twelfth of the columns from the next.

    >>> _column_ticks(list(range(10)) + [50, 100, 150, 200], [10, 11, 12, 13])
    [0, 2, 4, 6, 8, 10, 12]
    """
    from matplotlib.ticker import MaxNLocator

    if len(steps) <= 12:
        return list(range(len(steps)))
    even = [int(t) for t in MaxNLocator(nbins=8, integer=True).tick_values(0, len(steps) - 1)]
    apart = max(1, math.ceil(len(steps) / 12))
    chosen: list[int] = []
    for col in [0, *gaps, len(steps) - 1, *even]:
        if 0 <= col < len(steps) and all(abs(col - c) >= apart for c in chosen):
            chosen.append(col)
    return sorted(chosen)


def _activations(fig: Any, data: RunData) -> Any:
    ax = fig.add_subplot()
    if len(data.activations) > 1:
        _headroom_over_steps(ax, data)
        return None
    rows = sorted(((m, s) for m, s in data.activation_modules.items() if m != "(root)"),
                  key=lambda ms: -(1.0 if ms[1].nonfinite_forward_steps else (ms[1].headroom_ratio or 0.0)))[:20]
    if not rows:
        return False
    ratios = [1.0 if s.nonfinite_forward_steps else (s.headroom_ratio or 0.0) for _, s in rows]
    ax.barh([_short(m) for m, _ in rows], ratios,
            color=[_BAD if s.nonfinite_forward_steps else "#2e7d32" for _, s in rows])
    ax.invert_yaxis()
    fig.set_size_inches(9, 1.2 + 0.22 * len(rows))
    ax.axvline(1.0, color=_BAD, lw=1, ls="--")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    return None


def _headroom_over_steps(ax: Any, data: RunData) -> None:
    """Draw the largest activation over its dtype's maximum at each sampled step, on a y range that fits the data:
    the overflow line (1) only where it is within reach (bf16's maximum is about 3e38: a ratio near 1e-38 is an
    activation of about 3, and an axis down to it from 1 would show nothing)."""
    points = [(a.step, a.ratio) for a in data.activations if a.ratio]
    bad = [a for a in data.activations if a.nonfinite_module]
    if points:
        ax.plot(*zip(*points), color="#2e7d32", marker=".", label="largest activation / dtype max")
    if bad:
        ax.plot([a.step for a in bad], [1.0] * len(bad), "x", color=_BAD, ms=8,
                label=f"inf/NaN forward, first in {_short(bad[0].nonfinite_module, 30)}")
        ax.annotate(f"{_short(bad[0].nonfinite_module, 60)} overflows", (bad[0].step, 1.0), xytext=(8, -14),
                    textcoords="offset points", color=_BAD)
    ax.set_yscale("log")
    ratios = [r for _, r in points]
    low, high = min(ratios, default=1.0), max(ratios, default=1.0)
    if bad or high >= HEADROOM_IN_REACH:
        ax.axhline(1.0, color=_BAD, lw=1, ls="--")
        high = max(high, 1.0)
    else:
        ax.text(0.01, 0.95, f"overflow (1) is {1 / high:.1e}× above the largest", transform=ax.transAxes,
                va="top", color="#555")
    ax.set_ylim(low / 4, high * 4)   # a little room around the data on the log axis
    ax.set_ylabel("largest |activation| / dtype max")
    _run_range(ax, data)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right", fontsize=8)


def _lost(fig: Any, data: RunData) -> None:
    ax = fig.add_subplot()
    ax.plot(*zip(*data.lost), marker=".")
    ax.set_ylabel("lost (share)")
    _run_range(ax, data)
    ax.grid(alpha=0.3)


def write_pngs(loaded: Any, folder: str) -> list[str]:
    """Write the report page's figures as PNG files into ``folder`` (created if missing); return their paths.

    Args:
        loaded: what ``ampdoctor.ui.report_files.load_any`` returned.
        folder: the directory to write ``loss.png``, ``loss_scale.png``, ``grad_norms.png``, ``cast_fp16.png``, …
            into.

    Raises:
        ValueError: matplotlib is not installed, or the folder cannot be written.
    """
    if not have_matplotlib():
        raise ValueError(f"PNG figures need matplotlib: {INSTALL_HINT}")
    try:
        os.makedirs(folder, exist_ok=True)
        paths = []
        for figure in draw_figures(read_run(loaded.run, loaded.report.watch)):
            path = os.path.join(folder, f"{figure.key}.png")
            figure.png(path)
            paths.append(path)
    except OSError as exc:
        raise ValueError(f"cannot write PNG figures to {folder!r}: {exc.strerror}") from None
    return paths
