"""`ampdoctor demo`: the seed error on a tiny model, its diagnosis, and the repaired run. CPU, no download."""

from __future__ import annotations

import os
import tempfile

from rich.console import Console
from rich.rule import Rule as Heading
from rich.syntax import Syntax

# The classic mistake: the whole model is cast to fp16 (as `from_pretrained(..., torch_dtype=torch.float16)`
# does), then trained with fp16 autocast and a GradScaler.
DEMO_SCRIPT = '''\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
model.half()                   # <- the bug: trainable weights in float16
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(256, 32)
y = x[:, :1] * 2.0 + 1.0

for step in range(40):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)                # <- raises the ValueError
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    if step % 10 == 0 or step == 39:
        print(f"step {step:2d}  loss {loss.item():.4f}")
'''


def run_demo(fix: bool = True, console: Console | None = None) -> int:
    """Run the demo script twice: plain (it crashes and is explained), then with ``--fix`` (it trains).

    Returns 0 when the diagnosis names the fp16 parameters and, with ``fix``, the repaired run trains.
    """
    from ampdoctor.core.options import RunOptions
    from ampdoctor.runner.doctor import Doctor
    from ampdoctor.runner.launcher import run_script
    from ampdoctor.ui.console import render_report
    from ampdoctor.ui.plain import console as plain_console
    from ampdoctor.ui.plain import wrap

    console = console or plain_console()

    def events(line: str) -> None:  # wrapped between words, so that a piped demo stays within 80 columns
        for part in wrap(line, console.width):
            console.print(part, markup=False, highlight=False, soft_wrap=True)

    with tempfile.TemporaryDirectory(prefix="ampdoctor-demo-") as tmp:
        path = os.path.join(tmp, "train.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(DEMO_SCRIPT)
        console.print(Heading("the training script (train.py)"))
        console.print(Syntax(DEMO_SCRIPT, "python", theme="ansi_dark", line_numbers=True, word_wrap=True))
        console.print(Heading("1. ampdoctor run train.py"))
        first = run_script(path, [], Doctor(RunOptions(watch=False), on_event=events))
        console.print(render_report(first.report, show_exception=False))  # the traceback above ends with it
        diagnosed = first.exit_code != 0 and "AMP101" in first.report.codes()
        if not fix:
            return 0 if diagnosed else 1
        console.print(Heading("2. ampdoctor run --fix train.py"))
        second = run_script(path, [], Doctor(RunOptions(fix=True, watch=False), on_event=events))
        if second.exit_code == 0:
            console.print("ampdoctor: the unchanged script trained to the end with the fix applied.", style="green")
        else:
            console.print(render_report(second.report, show_exception=False))
        return 0 if diagnosed and second.exit_code == 0 else 1
