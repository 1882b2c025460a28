"""A Lightning loop on CPU: Trainer(precision="bf16-mixed"), a tiny LightningModule, 10 steps.

    python lightning_loop.py OUT [bf16-mixed|32-true] [STEPS]

saves ``{"state", "losses"}`` to OUT. ``train(precision, steps, callbacks)`` is what the tests call in-process.
(Lightning turns "16-mixed" on CPU into "bf16-mixed" with a warning, so it is not a separate case here.)
"""
import logging
import sys

import lightning as L
import torch
from torch import nn

for _name in ("lightning", "lightning.pytorch", "lightning.fabric"):
    logging.getLogger(_name).setLevel(logging.ERROR)


def keep(*objects) -> None:
    sink = sys.modules.get("harm_sink")
    if sink is not None:
        sink.keep(*objects)


class TinyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        keep(opt)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


def train(precision: str = "bf16-mixed", steps: int = 10, callbacks=()):
    L.seed_everything(0, verbose=False)
    x = torch.randn(512, 8)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(512, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    module = TinyModule()
    keep(module)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, precision=precision, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0, callbacks=list(callbacks))
    trainer.fit(module, loader)
    return module, trainer, module.losses


if __name__ == "__main__":
    out = sys.argv[1]
    precision = sys.argv[2] if len(sys.argv) > 2 else "bf16-mixed"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    module, _, losses = train(precision, steps)
    torch.save({"state": module.state_dict(), "losses": losses}, out)
