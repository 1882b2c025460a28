# Re-creates the mixed-precision structure of pytorch/examples, distributed/minGPT-ddp/mingpt/trainer.py (with
# main.py, model.py and char_dataset.py beside it; commit 77f55b912142, minGPT-ddp last changed in 698a89e5fc97).
# Written from scratch for ampdoctor's tests: an independent re-creation, no code copied.
# What it mirrors, in words: the process group comes from the variables torchrun sets (RANK, LOCAL_RANK,
# WORLD_SIZE, MASTER_ADDR, MASTER_PORT), here a single gloo process on CPU, and the model is wrapped in DDP; the
# scaler is torch.amp.GradScaler for the training device type; forward runs under fp16 autocast; and in the AMP
# branch the example clips with clip_grad_norm_(..., 1.0) right after the scaled backward, with no unscale_ before
# it, so it clips gradients that are still multiplied by the loss scale, then calls scaler.step and update.
# --fixed puts scaler.unscale_(optimizer) before the clip; --no-amp trains in fp32. Each epoch ends with an eval loss.
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

SPAN, DIM = 16, 48


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, num_heads=4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, h, future):
        a = self.ln1(h)
        h = h + self.attn(a, a, a, attn_mask=future, need_weights=False)[0]
        return h + self.mlp(self.ln2(h))


class CharModel(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.where = nn.Parameter(torch.zeros(1, SPAN, DIM))
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.ln_f = nn.LayerNorm(DIM)
        self.unembed = nn.Linear(DIM, vocab, bias=False)

    def forward(self, chars, nxt):
        future = torch.triu(torch.ones(SPAN, SPAN, dtype=torch.bool, device=chars.device), diagonal=1)
        h = self.embed(chars) + self.where
        for layer in self.layers:
            h = layer(h, future)
        logits = self.unembed(self.ln_f(h))
        return logits, F.cross_entropy(logits.flatten(0, 1), nxt.flatten())


def char_windows(text, stride=3):
    alphabet = sorted(set(text))
    ids = torch.tensor([alphabet.index(c) for c in text])
    starts = range(0, len(ids) - SPAN - 1, stride)
    xs = torch.stack([ids[s:s + SPAN] for s in starts])
    ys = torch.stack([ids[s + 1:s + SPAN + 1] for s in starts])
    return TensorDataset(xs, ys), len(alphabet)


def main():
    cli = argparse.ArgumentParser()
    cli.add_argument("--fixed", action="store_true", help="unscale_ before clipping")
    cli.add_argument("--no-amp", action="store_true", help="train in fp32")
    cli.add_argument("--epochs", type=int, default=2)
    opts = cli.parse_args()
    use_amp = not opts.no_amp

    dist.init_process_group(backend="gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    device_type = "cpu"
    torch.manual_seed(0)

    gen = torch.Generator().manual_seed(int(os.environ["LOCAL_RANK"]))
    words = "a pale moon rose over seven quiet hills and the old river sang to the reeds".split()
    text = " ".join(words[i] for i in torch.randint(0, len(words), (700,), generator=gen).tolist())
    corpus, vocab = char_windows(text)
    cut = int(0.9 * len(corpus))
    train_set, eval_set = Subset(corpus, range(cut)), Subset(corpus, range(cut, len(corpus)))
    train_loader = DataLoader(train_set, batch_size=8, sampler=DistributedSampler(train_set, shuffle=True, seed=0))
    eval_loader = DataLoader(eval_set, batch_size=32, sampler=DistributedSampler(eval_set, shuffle=False))

    model = DistributedDataParallel(CharModel(vocab).to(device_type))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scaler = torch.amp.GradScaler(device_type) if use_amp else None

    def one_batch(chars, nxt, train):
        with torch.set_grad_enabled(train), torch.amp.autocast(device_type, dtype=torch.float16, enabled=use_amp):
            _, loss = model(chars, nxt)
        if not train:
            return loss.item()
        optimizer.zero_grad(set_to_none=True)
        if not use_amp:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            return loss.item()
        scaler.scale(loss).backward()
        if opts.fixed:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # BUG unless --fixed: gradients still scaled
        scaler.step(optimizer)
        scaler.update()
        return loss.item()

    for epoch in range(opts.epochs):
        train_loader.sampler.set_epoch(epoch)
        for i, (chars, nxt) in enumerate(train_loader):
            value = one_batch(chars, nxt, train=True)
            if i % 40 == 0:
                print(f"epoch {epoch} iter {i}: train loss {value:.5f}")
        losses = [one_batch(chars, nxt, train=False) for chars, nxt in eval_loader]
        print(f"epoch {epoch}: eval loss {sum(losses) / len(losses):.5f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
