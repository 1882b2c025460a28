# Re-creates: pytorch/examples · distributed/FSDP2/example.py (+ model.py, utils.py) · 77f55b912142
# (folder last changed in 32fdb49). An independent re-creation written from scratch for ampdoctor's tests: no code,
# comments or structure are copied from the original.
#
# What it mirrors, in words: a decoder-only transformer built on the meta device, each block sharded with
# `fully_shard` and then the root; with `--mixed-precision` every `fully_shard` gets a `MixedPrecisionPolicy` whose
# parameters are bfloat16 and whose gradient reduction is float32; `to_empty` on the real device and a
# `reset_parameters` of every submodule; the process group from torchrun's variables with the backend that
# torch picks for the device (gloo on CPU); plain Adam at lr 1e-2; ten steps on random tokens with the loss
# `logits.sum()`, `clip_grad_norm_(…, max_norm=1.0)` on the DTensor gradients, `step`, `zero_grad`. No GradScaler
# and no autocast: FSDP2 casts the parameters itself. Tiny sizes; rank 0 prints its loss at each step.
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--mixed-precision", action="store_true")
parser.add_argument("--fp16", action="store_true", help="float16 parameters in the policy instead of bfloat16")
opts = parser.parse_args()

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 96, 32, 4, 3, 16, 8


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, h):
        b, t, _ = h.shape
        split = lambda z: z.view(b, t, HEADS, DIM // HEADS).transpose(1, 2)  # noqa: E731
        mixed = nn.functional.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)),
                                                           is_causal=True)
        return self.o(mixed.transpose(1, 2).reshape(b, t, DIM))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = SelfAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, h):
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h))


def main():
    device = torch.device("cpu")
    dist.init_process_group(backend=dist.get_default_backend_for_device(device))
    rank = dist.get_rank()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Decoder()
    shard_options = {}
    if opts.mixed_precision:
        shard_options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.float16 if opts.fp16 else torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, **shard_options)
    fully_shard(model, **shard_options)
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(10):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
        loss = model(ids).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
