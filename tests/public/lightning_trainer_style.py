# Re-creates the mixed-precision structure of Lightning-AI/pytorch-lightning, examples/pytorch/basics/transformer.py
# (a LightningModule trained by lightning.pytorch.Trainer). Written from scratch for ampdoctor's tests: an
# independent re-creation, no code copied.
# What it mirrors, in words: a LightningModule owns the demo Transformer that ships in lightning.pytorch.demos and
# returns the loss from training_step; configure_optimizers returns one SGD optimizer; the Trainer is given the
# precision on the command line ("bf16-mixed", "16-true", ...), so Lightning wraps the optimizer (LightningOptimizer),
# steps it with a closure, and for "16-true" casts the whole module to float16. Synthetic tokens replace WikiText-2.
# With a second argument "ddp" the Trainer runs two CPU processes with strategy="ddp" (gloo), which re-runs this script
# for rank 1, as in the example's multi-device runs; only rank 0 prints its loss.
# Usage: python lightning_trainer_style.py PRECISION [ddp]
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ = 24, 16


class LanguageModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Transformer(vocab_size=VOCAB, ninp=32, nhid=64, nhead=2, nlayers=1)

    def training_step(self, batch, batch_idx):
        src, tgt = batch
        loss = F.nll_loss(self.net(src, tgt), tgt.reshape(-1))
        if self.global_rank == 0:
            print(f"step {self.global_step}: loss {loss.item():.4f}")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def tokens(n, seed):
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(0, VOCAB, (n, 1), generator=gen)
    seq = (first + torch.arange(SEQ + 1)) % VOCAB   # the next token is the current one plus 1
    return TensorDataset(seq[:, :-1], seq[:, 1:])


if __name__ == "__main__":
    pl.seed_everything(3, verbose=False)
    ddp = dict(devices=2, strategy="ddp") if sys.argv[2:] == ["ddp"] else {}
    trainer = pl.Trainer(accelerator="cpu", precision=sys.argv[1], max_steps=8, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **ddp)
    trainer.fit(LanguageModel(), DataLoader(tokens(64, 0), batch_size=8))
