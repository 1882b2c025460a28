"""A LightningModule with a stray fp16 head, diagnosed (and with ``--fix`` repaired) by ampdoctor's Lightning callback.

The encoder is float32; the head was cast with ``.half()``. Under ``16-mixed`` the precision plugin's GradScaler
refuses the head's fp16 gradients at the first step (``ValueError: Attempting to unscale FP16 gradients.``). The
callback writes its pre-flight report before that step (naming ``head.weight`` and ``head.bias``), adds the crash
explanation when it happens, and prints the report once, above the traceback:

    python examples/lightning_callback.py                # the crash explained (the report), then its traceback
    python examples/lightning_callback.py --fix          # the head is upcast before the first step; trains to the end
    python examples/lightning_callback.py --no-stray     # a clean run: the watch's summary and no findings

On a GPU, ``precision="16-mixed"`` makes that GradScaler itself. On a CPU Lightning turns ``16-mixed`` into
``bf16-mixed`` (no GradScaler), so the script hands Lightning the same plugin with a CPU GradScaler.
"""
import argparse

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from ampdoctor.integrations.lightning import AmpDoctorCallback

cli = argparse.ArgumentParser()
cli.add_argument("--fix", action="store_true", help="upcast trainable half parameters before the first step")
cli.add_argument("--no-stray", action="store_true", help="leave the head in float32: a clean run")
cli.add_argument("--steps", type=int, default=20)
cli.add_argument("--json", default="ampdoctor-lightning.json", help="where the callback writes its report")
args = cli.parse_args()


class Regressor(L.LightningModule):
    def __init__(self, stray: bool) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
        self.head = torch.nn.Linear(64, 1)
        if stray:
            self.head.half()   # copied from an inference script

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.head(self.encoder(x)).float(), y)
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-6)


torch.manual_seed(0)
x = torch.randn(256, 32)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1] * 2 + 1), batch_size=32, shuffle=True)
plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")) if not torch.cuda.is_available() \
    else MixedPrecision("16-mixed", "cuda")
trainer = L.Trainer(max_steps=args.steps, plugins=[plugin], logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[AmpDoctorCallback(json_path=args.json, fix=args.fix)])
trainer.fit(Regressor(stray=not args.no_stray), data)
print(f"trained {trainer.global_step} steps; report written to {args.json}")
