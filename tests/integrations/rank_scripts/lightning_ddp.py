"""A tiny Lightning fit on two CPU processes (gloo), bf16-mixed, with ampdoctor's callback.

python lightning_ddp.py STRATEGY MODE OUT

STRATEGY: ``ddp_spawn`` or ``ddp``. OUT: the folder for ``report.json`` and the ``logs`` folder.
MODE:
    seed    a stray ``.half()`` on the head, on every rank: trainable float16 parameters (AMP101) on both ranks
    crash1  rank 1 alone raises a RuntimeError in ``training_step`` at step 2
"""

import sys

import lightning as L
import torch

from ampdoctor.integrations.lightning import AmpDoctorCallback


class Net(L.LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 1)
        if mode == "seed":
            self.head.half()   # the stray cast, on every rank

    def training_step(self, batch, batch_idx):
        if self.mode == "crash1" and self.global_rank == 1 and batch_idx == 2:
            raise RuntimeError("rank 1 broke at step 2")
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.encoder(x)).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def main() -> None:
    strategy, mode, out = sys.argv[1:4]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)), batch_size=4)
    callback = AmpDoctorCallback(json_path=f"{out}/report.json", log_dir=f"{out}/logs", every=1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed", max_steps=4,
                        callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=True)
    trainer.fit(Net(mode), data)
    print(f"fit done on rank {trainer.global_rank}", flush=True)


if __name__ == "__main__":
    main()
