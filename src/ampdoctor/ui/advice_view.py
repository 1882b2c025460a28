"""Draw an ``Advice`` for the console: the per-strategy table, the device, the evidence and the recommendation."""

from __future__ import annotations

from typing import Any

from ampdoctor.core.words import counted

__all__ = ["render_advice", "gib"]


def gib(n: int | None) -> str:
    """Return bytes as GiB with two decimals, ``-`` for None.

    >>> gib(3 * 2**30), gib(None)
    ('3.00', '-')
    """
    return "-" if n is None else f"{n / 2**30:.2f}"


def render_advice(advice: Any) -> Any:
    """Return a rich renderable of ``advice``."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(
        f"ampdoctor advise: {advice.model}: {advice.parameters:,} parameters ({advice.trainable:,} trainable), "
        f"batch {advice.batch_size} x {advice.seq_len}, optimizer {advice.optimizer}, "
        f"{counted(advice.devices, 'device')}"
        + (f", budget {gib(advice.budget)} GiB" if advice.budget else ""), style="bold")]
    from rich import box

    table = Table(title="GiB per device", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                  collapse_padding=True)
    for header in ("strategy", "weights", "grads", "optim", "masters", "activ.", "total", "fits"):
        table.add_column(header, justify="left" if header == "strategy" else "right", no_wrap=True)
    for row in advice.strategies:
        b = row["bytes"]
        fits = {True: "yes", False: "no", None: "-"}[row["fits"]]
        table.add_row(row["key"], gib(b["weights"]), gib(b["gradients"]), gib(b["optimizer_state"]),
                      gib(b["master_weights"]), gib(b["activations"]), gib(b["total"]), fits)
    parts.append(table)
    parts.append(Text(f"LoRA r={advice.lora['rank']}: {advice.lora['parameters']:,} adapter parameters on "
                      f"{advice.lora['targets']} layers ({advice.lora['rule']})", style="dim"))
    errors = {r["activation_detail"]["run"]: r["activation_detail"]["error"] for r in advice.strategies
              if r["activation_detail"] and r["activation_detail"]["error"]}
    for run, error in errors.items():
        parts.append(Text(f"activations of the {run} run not measured: {error}", style="yellow"))
    device = advice.device
    parts.append(Text(f"device: {device['device']} ({device['name']}): bf16 {_yes(device['bf16'])}, TF32 "
                      f"{_yes(device['tf32'])}; prefer {device['prefer']}: {device['why']}"))
    if advice.evidence:
        for line in advice.evidence["lines"]:
            parts.append(Text(f"log: {line}"))
    rec = advice.recommendation or {}
    if "strategy" in rec:
        parts.append(Text(f"recommended: {rec['strategy']} ({rec['title']}), {gib(rec['total'])} GiB: {rec['why']}",
                          style="bold green"))
        for framework, code in rec["recipes"].items():
            parts.append(Text(f"  {framework}: " + code.replace("\n", "\n    ")))
    else:
        parts.append(Text(f"no recommendation: {rec['why'] if 'why' in rec else 'none fits'}", style="bold yellow"))
    for line in advice.notes:
        parts.append(Text(line, style="dim"))
    return Group(*parts)


def _yes(value: Any) -> str:
    return "yes" if value else "no"
