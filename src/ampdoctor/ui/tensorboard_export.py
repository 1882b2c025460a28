"""The watch's scalars as TensorBoard events, from a flight recorder (``ampdoctor report LOG --tensorboard DIR``).

TensorBoard is where many runs already log their loss; putting the loss scale, skipped steps, the unscaled
gradient norms and the underflow shares next to it lines them up by step. Written with torch's own
``torch.utils.tensorboard.SummaryWriter`` (it needs the ``tensorboard`` package, an optional dependency).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["INSTALL_TENSORBOARD", "write_tensorboard"]

INSTALL_TENSORBOARD = 'TensorBoard export needs the tensorboard package: pip install tensorboard'
MAX_MODULES = 50  # per-module norm curves written; the largest by their last norm


def write_tensorboard(loaded: Any, folder: str) -> int:
    """Write the run's scalars under ``folder`` as TensorBoard events; return how many values were written.

    Tags: ``ampdoctor/loss_scale``, ``ampdoctor/skipped_steps`` (running count), ``ampdoctor/grad_norm``,
    ``ampdoctor/grad_norm/<module>``, ``ampdoctor/<format>_underflow`` (the worst module's share),
    ``ampdoctor/lost_updates``. Non-finite values are written as they are (TensorBoard shows them as gaps).

    Raises:
        ValueError: the ``tensorboard`` package is missing (with how to install it).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(INSTALL_TENSORBOARD) from None
    from ampdoctor.ui.report_files import run_data, series

    data = run_data(loaded)
    tags = {"loss scale": "loss_scale", "skipped steps (total)": "skipped_steps", "global grad norm": "grad_norm",
            "lost updates (fraction)": "lost_updates"}
    written = 0
    writer = SummaryWriter(log_dir=folder)
    try:
        for name, values in series(loaded).items():
            tag = tags.get(name) or name.replace("worst ", "").replace(" ", "_")
            for step, value in values:
                writer.add_scalar(f"ampdoctor/{tag}", float(value), global_step=int(step))
                written += 1
        last = {m: v[-1][1] for m, v in data.module_norms.items() if v}
        shown = sorted(last, key=lambda m: -(last[m] if math.isfinite(last[m]) else math.inf))[:MAX_MODULES]
        for module in shown:
            for step, value in data.module_norms[module]:
                writer.add_scalar(f"ampdoctor/grad_norm/{module}", float(value), global_step=int(step))
                written += 1
    finally:
        writer.close()
    return written
