"""An accelerate training loop with a stray fp16 head: the seed error the way accelerate users meet it.

The backbone is float32; the classification head was cast with ``.half()`` (copied from an inference script, say).
accelerate's fp16 mixed precision autocasts the forward and scales the loss with a GradScaler, so the first
``accelerator.clip_grad_norm_`` (which unscales the gradients) raises ``ValueError: Attempting to unscale FP16
gradients.`` without naming the head.

    ampdoctor run examples/accelerate_train.py          # names head.weight and head.bias, explains the crash
    ampdoctor run --fix examples/accelerate_train.py    # upcasts the head and trains to the end
    accelerate launch --cpu --num_processes 1 -m ampdoctor run examples/accelerate_train.py
    accelerate launch --multi_gpu --num_processes 2 -m ampdoctor run --fix examples/accelerate_train.py  # 2 ranks

Options: ``--accumulate N`` (``accelerator.accumulate`` over N micro-batches), ``--no-clip`` (the crash then comes
from ``optimizer.step()``), ``--no-stray`` (no ``.half()``: a clean run), ``--bf16``, ``--steps N``,
``--init-scale S`` (a first loss scale so large that the first updates overflow and are skipped).

On a GPU this is ``Accelerator(mixed_precision="fp16")``. accelerate 1.x refuses fp16 on a CPU silently (no
autocast, no GradScaler: ``native_amp`` stays False), so on a CPU the script switches on what the GPU path would
have set up, before ``prepare``: ``native_amp = True`` makes ``prepare`` wrap ``model.forward`` in
``torch.autocast("cpu", dtype=torch.float16)`` and makes ``clip_grad_norm_`` unscale; ``accelerator.scaler`` is
the GradScaler that ``backward`` scales the loss with and that each ``AcceleratedOptimizer`` steps through.
"""
import argparse

import torch
from accelerate import Accelerator
from torch import nn

cli = argparse.ArgumentParser()
cli.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
cli.add_argument("--steps", type=int, default=8, help="optimizer steps")
cli.add_argument("--no-clip", dest="clip", action="store_false")
cli.add_argument("--no-stray", dest="stray", action="store_false", help="leave the head in float32")
cli.add_argument("--bf16", action="store_true", help="bf16 mixed precision (no GradScaler)")
cli.add_argument("--init-scale", type=float, default=2.0**16, help="the GradScaler's first loss scale")
opts = cli.parse_args()

accelerator = Accelerator(mixed_precision="bf16" if opts.bf16 else "fp16", cpu=True,
                          gradient_accumulation_steps=opts.accumulate)
if not opts.bf16 and accelerator.device.type == "cpu" and accelerator.scaler is None:
    accelerator.native_amp = True                          # what accelerate sets up for fp16 on a GPU
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=opts.init_scale)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


torch.manual_seed(0)
model = Classifier()
if opts.stray:
    model.head.half()                                      # the stray cast
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(opts.steps * opts.accumulate * 8, 16),
                                      torch.randint(0, 4, (opts.steps * opts.accumulate * 8,)))
loader = torch.utils.data.DataLoader(data, batch_size=8)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

skipped = []                                               # the updates accelerate says it skipped
for batch, (x, y) in enumerate(loader):
    with accelerator.accumulate(model):
        loss = nn.functional.cross_entropy(model(x).float(), y)
        accelerator.backward(loss)
        if accelerator.sync_gradients and opts.clip:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if accelerator.sync_gradients:
            update = (batch + 1) // opts.accumulate - 1
            if accelerator.optimizer_step_was_skipped:
                skipped.append(update)
            accelerator.print(f"update {update}  loss {loss.item():.6f}")
accelerator.print(f"done: {update + 1} optimizer steps over {batch + 1} micro-batches; skipped updates: {skipped}")
