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

from ampdoctor.ui.run_data import RunData, read_run

__all__ = ["Figure", "have_matplotlib", "draw_figures", "write_pngs", "INSTALL_HINT"]

INSTALL_HINT = 'pip install "ampdoctor[report]"'
MAX_HEATMAP_ROWS = 30  # modules shown in a heatmap: the ones with the largest shares; the rest are counted
MAX_NORM_LINES = 8  # per-module gradient norm lines besides the global norm
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
    """Return whether matplotlib can be imported (``pip install "ampdoctor[report]"``)."""
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
        yield "nonfinite_grads", "Gradient entries that are inf/NaN, per module and sampled step (% of entries)", \
            lambda fig: _heatmaps(fig, data, [("inf/NaN gradients", "nonfinite")])
    if len(data.activations) > 1:
        yield "activations", "Activation headroom over sampled steps: the largest activation over the largest " \
                             "value its dtype holds (1 = overflow); red ×: an inf/NaN forward", \
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
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")


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
    ax.set_xlabel("step")
    ax.set_ylabel("L2 norm (unscaled)" if finite_total or top else "")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)


def _heatmaps(fig: Any, data: RunData, panels: list[tuple[str, str]]) -> None:
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    modules: list[str] = []
    for _, key in panels:
        modules += [m for m in data.cast[key] if m not in modules]
    worst = {m: max((v or 0.0 for _, key in panels for v in data.cast[key].get(m, [])), default=0.0)
             for m in modules}
    shown = sorted(sorted(modules, key=lambda m: -worst[m])[:MAX_HEATMAP_ROWS], key=modules.index)
    fig.set_size_inches(9, 1.2 + 0.22 * len(shown))
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    steps = data.cast_steps
    for ax, (title, key) in zip(axes, panels):
        grid = np.full((len(shown), len(steps)), np.nan)
        for row, module in enumerate(shown):
            values = data.cast[key].get(module, [])
            for col, value in enumerate(values[:len(steps)]):
                if value is not None:
                    grid[row, col] = 100.0 * value
        top = max(1.0, float(np.nanmax(grid)) if np.isfinite(grid).any() else 1.0)
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma_r", vmin=0.0, vmax=top,
                          extent=(-0.5, len(steps) - 0.5, len(shown) - 0.5, -0.5))
        ticks = [int(t) for t in MaxNLocator(nbins=8, integer=True).tick_values(0, len(steps) - 1)
                 if 0 <= t < len(steps)]
        ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
        ax.set_yticks(range(len(shown)), [_short(m) for m in shown])
        ax.set_xlabel("step")
        ax.set_title(title if np.nanmax(grid, initial=0.0) > 0 else f"{title}: none")
        fig.colorbar(image, ax=ax, label="% of entries", shrink=0.9)
    hidden = len(modules) - len(shown)
    if hidden:
        fig.suptitle(f"{len(shown)} of {len(modules)} modules: the {hidden} not shown stay below "
                     f"{100 * max((worst[m] for m in modules if m not in shown), default=0.0):.2g}%", fontsize=9)


def _activations(fig: Any, data: RunData) -> Any:
    ax = fig.add_subplot()
    over_steps = len(data.activations) > 1
    if over_steps:
        points = [(a.step, a.ratio) for a in data.activations if a.ratio]
        if points:
            ax.plot(*zip(*points), color="#2e7d32", marker="." if len(points) < 60 else None,
                    label="largest activation / dtype max")
        bad = [a for a in data.activations if a.nonfinite_module]
        if bad:
            ax.plot([a.step for a in bad], [1.0] * len(bad), "x", color=_BAD, ms=8,
                    label=f"inf/NaN forward, first in {_short(bad[0].nonfinite_module, 30)}")
            ax.annotate(f"{_short(bad[0].nonfinite_module, 60)} overflows", (bad[0].step, 1.0), xytext=(8, -14),
                        textcoords="offset points", color=_BAD)
        ax.set_xlabel("step")
    else:
        rows = sorted(((m, s) for m, s in data.activation_modules.items() if m != "(root)"),
                      key=lambda ms: -(1.0 if ms[1].nonfinite_forward_steps else (ms[1].headroom_ratio or 0.0)))[:20]
        if not rows:
            return False
        ratios = [1.0 if s.nonfinite_forward_steps else (s.headroom_ratio or 0.0) for _, s in rows]
        ax.barh([_short(m) for m, _ in rows], ratios,
                color=[_BAD if s.nonfinite_forward_steps else "#2e7d32" for _, s in rows])
        ax.invert_yaxis()
        fig.set_size_inches(9, 1.2 + 0.22 * len(rows))
    ax.axhline(1.0, color=_BAD, lw=1, ls="--") if over_steps else ax.axvline(1.0, color=_BAD, lw=1, ls="--")
    (ax.set_yscale if over_steps else ax.set_xscale)("log")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right", fontsize=8)
    return None


def _lost(fig: Any, data: RunData) -> None:
    ax = fig.add_subplot()
    ax.plot(*zip(*data.lost), marker=".")
    ax.set_ylabel("lost (share)")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def write_pngs(loaded: Any, folder: str) -> list[str]:
    """Write the report page's figures as PNG files into ``folder`` (created if missing); return their paths.

    Args:
        loaded: what ``ampdoctor.ui.report_files.load_any`` returned.
        folder: the directory to write ``loss_scale.png``, ``grad_norms.png``, ``cast_fp16.png``, … into.

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
