# Re-creates the mixed-precision structure of Lightning-AI/pytorch-lightning, examples/fabric/language_model/train.py
# (commit 7f0c3436cd3f; the file last changed in 1b26ac4cf5c8). Written from scratch for ampdoctor's tests: an
# independent re-creation, no code copied.
# What it mirrors, in words: the precision is whatever Fabric is told (here LT_PRECISION, the variable that
# `fabric run --precision=...` sets), so "16-true" casts the whole model to float16 and trains it with plain SGD and
# no master weights, while "16-mixed"/"bf16-mixed" keep float32 weights under autocast; model and optimizer go
# through fabric.setup, the backward pass through fabric.backward, gradients are clipped by value through
# fabric.clip_gradients before optimizer.step and zero_grad. The model is the Transformer that ships in
# lightning.pytorch.demos; the tokens are synthetic instead of WikiText-2.
import os

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ = 24, 20


def token_pairs(n, seed):
    # a noisy cyclic sequence: the next token is usually the current one plus 1 (mod VOCAB)
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(0, VOCAB, (n, 1), generator=gen)
    noise = (torch.rand(n, SEQ + 1, generator=gen) < 0.1).long()
    seq = (first + torch.arange(SEQ + 1) + noise.cumsum(1)) % VOCAB
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def main():
    fabric = Fabric(accelerator="cpu", precision=os.environ["LT_PRECISION"])
    fabric.seed_everything(7)

    net = Transformer(vocab_size=VOCAB, ninp=32, nhid=64, nhead=2, nlayers=1)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    net, sgd = fabric.setup(net, sgd)
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(token_pairs(96, 0), batch_size=16, shuffle=True), DataLoader(token_pairs(32, 1), batch_size=16))

    for epoch in range(3):
        net.train()
        for i, (src, tgt) in enumerate(train_loader):
            loss = F.nll_loss(net(src, tgt), tgt.reshape(-1))
            fabric.backward(loss)
            fabric.clip_gradients(net, sgd, clip_val=0.25)
            sgd.step()
            sgd.zero_grad()
            fabric.print(f"epoch {epoch} batch {i}: loss {loss.item():.4f}")
        net.eval()
        with torch.no_grad():
            val = torch.stack([F.nll_loss(net(s, t), t.reshape(-1)) for s, t in val_loader]).mean()
        fabric.print(f"epoch {epoch}: val loss {val.item():.4f}")


if __name__ == "__main__":
    main()
