"""Draw an ``Advice`` for the console: the per-strategy table, the device, the evidence and the recommendation."""

from __future__ import annotations

from typing import Any, Iterator

from ampdoctor.core.words import counted
from ampdoctor.ui.plain import INDENT, wrap, wrap_code

__all__ = ["render_advice", "gib"]


def gib(n: int | None) -> str:
    """Return bytes as GiB with two decimals, ``-`` for None.

    >>> gib(3 * 2**30), gib(None)
    ('3.00', '-')
    """
    return "-" if n is None else f"{n / 2**30:.2f}"


def render_advice(advice: Any) -> Any:
    """Return a rich renderable of ``advice``, laid out for the width it is drawn at."""
    return AdviceDrawing(advice)


class AdviceDrawing:
    """``advice`` as lines of at most the drawing's width: prose wrapped between words with a hanging indent, code
    never broken (a long comment goes on under its ``#``), and the table at its own width.

    A path, a module name or a line of code longer than the width stays whole on its line, past the width: rich
    would otherwise fold it in the middle, and a path that has been cut cannot be pasted. No line ends in a space.
    """

    def __init__(self, advice: Any) -> None:
        self.advice = advice

    def __rich_console__(self, console: Any, options: Any) -> Iterator[Any]:
        from rich.text import Text

        advice, width = self.advice, options.max_width

        def lines(text: str, style: str = "", first: str = "") -> Iterator[Text]:
            for line in wrap(text, width, first):
                yield _whole(line, style)

        yield _whole(f"ampdoctor advise: {advice.model}", "bold")   # the path on one line, to copy
        yield from lines(f"{advice.parameters:,} parameters ({advice.trainable:,} trainable), batch "
                         f"{advice.batch_size} x {advice.seq_len}, optimizer {advice.optimizer}, "
                         f"{counted(advice.devices, 'device')}"
                         + (f", budget {gib(advice.budget)} GiB" if advice.budget else ""), "bold", INDENT)
        yield _whole("GiB per device")
        table = _table(advice)
        yield from console.render(table, options.update_width(max(width, _natural_width(console, options, table))))
        lora = advice.lora
        yield from lines(f"LoRA r={lora['rank']}: {lora['parameters']:,} adapter parameters on {lora['targets']} "
                         f"layers ({lora['rule']})", "dim")
        errors = {r["activation_detail"]["run"]: r["activation_detail"]["error"] for r in advice.strategies
                  if r["activation_detail"] and r["activation_detail"]["error"]}
        for run, error in errors.items():
            yield from lines(f"activations of the {run} run not measured: {error}", "yellow")
        device = advice.device
        yield from lines(f"device: {device['device']} ({device['name']}): bf16 {_yes(device['bf16'])}, TF32 "
                         f"{_yes(device['tf32'])}; prefer {device['prefer']}: {device['why']}")
        for line in (advice.evidence or {}).get("lines", []):
            yield from lines(f"log: {line}")
        rec = advice.recommendation or {}
        if rec.get("strategy"):
            yield from lines(f"recommended: {rec['strategy']} ({rec['title']}), {gib(rec['total'])} GiB: "
                             f"{rec['why']}", "bold green")
            for framework, code in rec["recipes"].items():
                yield from (_whole(line) for line in _recipe_lines(framework, code, width))
        else:
            yield from lines(f"no recommendation: {rec.get('why', 'none fits')}", "bold yellow")
        for note in advice.notes:
            yield from lines(note, "dim")


def _whole(line: str, style: str = "") -> Any:
    """A line that rich prints as it is: not folded, not padded."""
    from rich.text import Text

    return Text(line, style=style, no_wrap=True, overflow="ignore")


def _table(advice: Any) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    for header in ("strategy", "weights", "grads", "optim", "masters", "activ.", "total", "fits"):
        table.add_column(header, justify="left" if header == "strategy" else "right", no_wrap=True)
    for row in advice.strategies:
        b = row["bytes"]
        fits = {True: "yes", False: "no", None: "-"}[row["fits"]]
        table.add_row(row["key"], gib(b["weights"]), gib(b["gradients"]), gib(b["optimizer_state"]),
                      gib(b["master_weights"]), gib(b["activations"]), gib(b["total"]), fits)
    return table


def _natural_width(console: Any, options: Any, table: Any) -> int:
    """The table's width with nothing cut: narrower than that, rich would shorten the strategy names to 'amp_…'."""
    from rich.measure import Measurement

    return Measurement.get(console, options.update_width(10**4), table).maximum


def _recipe_lines(framework: str, code: str, width: int) -> list[str]:
    """``  torch: CODE`` when the code is one line that fits; else the name, then the code indented below it."""
    code_lines = code.splitlines()
    inline = f"  {framework}: {code}"
    if len(code_lines) == 1 and len(inline) <= width:
        return [inline]
    return [f"  {framework}:"] + [line for code_line in code_lines for line in wrap_code(code_line, width, INDENT)]


def _yes(value: Any) -> str:
    return "yes" if value else "no"
