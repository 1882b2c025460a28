# source: https://github.com/Lightning-AI/pytorch-lightning/issues/7078 (failures.md row 9)
# reproduces: a LightningModule with one parameter created in fp16 (nn.Parameter(torch.HalfTensor(...)), an
#   ArcFace-style margin head) under fp16 mixed precision -> ValueError: Attempting to unscale FP16 gradients.
# expect: AMP101
# expect-detail: AMP101 \bcenters\b
# fix: finishes
import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn


class Embedder(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.centers = nn.Parameter(torch.HalfTensor(4, 8).normal_())  # the stray fp16 parameter

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = nn.functional.normalize(self.body(x)) @ nn.functional.normalize(self.centers).t()
        loss = nn.functional.cross_entropy(logits.float() * 8.0, y)
        assert torch.isfinite(loss), "non-finite loss"
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
trainer = pl.Trainer(accelerator="cpu", plugins=[MixedPrecision("16-mixed", "cpu")], max_steps=6, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Embedder(), torch.utils.data.DataLoader(data, batch_size=16))
print("trained", trainer.global_step, "steps")
