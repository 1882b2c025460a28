# Re-creates the mixed-precision structure of karpathy/nanoGPT, train.py (commit 3adf61e154c3; the file last
# changed in dc81cb368ce3). Written from scratch for ampdoctor's tests: an independent re-creation (no code copied
# beyond the two one-line expressions named below).
# What it mirrors, in words: the context manager is a no-op on CPU and torch.amp.autocast with the requested dtype
# elsewhere; the scaler is the deprecated torch.cuda.amp.GradScaler, enabled exactly when the requested dtype is
# float16 (so on a CPU-only machine torch switches it off again and the run is plain fp32); gradients are
# accumulated over micro-batches with the loss divided by their number; before clipping the optimizer's gradients
# are unscaled; then scaler.step, scaler.update and zero_grad(set_to_none=True). The dtype comes from the command
# line. The expressions that build ctx and scaler (and the dtype-name mapping they use) are nanoGPT's on purpose:
# they are the pattern under test. Usage: python nanogpt_style.py --dtype=float16|bfloat16|float32 [--iters=N]
import argparse
import math
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, CONTEXT, WIDTH, HEADS, DEPTH = 64, 16, 32, 2, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_a = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.norm_b = nn.LayerNorm(WIDTH)
        self.ff = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = self.qkv(self.norm_a(h)).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out(att.transpose(1, 2).reshape(b, t, WIDTH))
        return h + self.ff(self.norm_b(h))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied input/output embedding
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx, targets):
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def main():
    cli = argparse.ArgumentParser()
    cli.add_argument("--dtype", default="float16", choices=["float32", "bfloat16", "float16"])
    cli.add_argument("--device", default="cpu")
    cli.add_argument("--iters", type=int, default=12)
    cli.add_argument("--accum", type=int, default=2)
    opts = cli.parse_args()

    torch.manual_seed(1337)
    device_type = "cuda" if "cuda" in opts.device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[opts.dtype]
    dtype = opts.dtype
    ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

    stream = torch.randint(0, VOCAB, (8000,), generator=torch.Generator().manual_seed(0))
    held_out = torch.randint(0, VOCAB, (1000,), generator=torch.Generator().manual_seed(1))

    def batch(source, n=4):
        starts = torch.randint(0, len(source) - CONTEXT - 1, (n,))
        x = torch.stack([source[s:s + CONTEXT] for s in starts])
        y = torch.stack([source[s + 1:s + 1 + CONTEXT] for s in starts])
        return x.to(opts.device), y.to(opts.device)

    model = TinyGPT().to(opts.device)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                   {"params": vectors, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95))
    scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))

    def lr_at(it, warmup=3, peak=3e-3, floor=3e-4):
        if it < warmup:
            return peak * (it + 1) / warmup
        return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * (it - warmup) / max(1, opts.iters - warmup)))

    x, y = batch(stream)
    for it in range(opts.iters + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it)
        if it % 6 == 0:
            model.eval()
            with torch.no_grad(), ctx:
                _, val = model(*batch(held_out))
            model.train()
            print(f"step {it}: val loss {val.item():.4f}")
        for _ in range(opts.accum):
            with ctx:
                _, loss = model(x, y)
                loss = loss / opts.accum
            x, y = batch(stream)
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        print(f"iter {it}: loss {loss.item() * opts.accum:.4f}")


if __name__ == "__main__":
    main()
