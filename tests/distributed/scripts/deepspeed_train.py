"""A DeepSpeed training loop on the CPU (gloo), in the shape of DeepSpeedExamples' training/cifar/cifar10_deepspeed.py:
``deepspeed.initialize`` from a config dict, then ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``.

python deepspeed_train.py [--stage 0-3] [--dtype bf16|fp32] [--steps N] [--clip C] [--check]

Every rank sees the same batches, so a run on N ranks trains exactly like one process (the gradients averaged over
the ranks are those of one process). fp16 is not run: DeepSpeed refuses it on a CPU ("Type fp16 is not supported on
your device"). ``--check`` calls ``ampdoctor.check`` and ``ampdoctor.fix`` on the real engine after training and
prints what they said as one JSON line starting with ``CHECK``.
"""

import argparse
import json
import os

import deepspeed
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=2)
parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--clip", type=float, default=0.0)
parser.add_argument("--check", action="store_true")
parser.add_argument("--local_rank", type=int, default=-1)   # what the deepspeed launcher passes
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))
config = {"train_batch_size": 4 * int(os.environ.get("WORLD_SIZE", "1")), "steps_per_print": 10**6,
          "bf16": {"enabled": args.dtype == "bf16"}, "gradient_clipping": args.clip,
          "zero_optimization": {"stage": args.stage}}
# a client torch optimizer with two groups, as the Hugging Face Trainer builds it (no weight decay on biases and
# norms); DeepSpeed then steps it once per group. (DeepSpeed's own FusedAdam would cost a JIT op load.)
decay = [p for n, p in model.named_parameters() if p.dim() > 1]
rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
client = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)
dtype = next(engine.parameters()).dtype
gen = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x, y = torch.randn(4, 16, generator=gen).to(dtype), torch.randint(0, 4, (4,), generator=gen)
    loss = nn.functional.cross_entropy(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
    if engine.global_rank == 0:   # DeepSpeed's own global norm of the gradients, before any clipping (not in fp32)
        norm = engine.get_global_grad_norm()
        print(f"step {step} loss {loss.item():.6f} grad_norm {'-' if norm is None else f'{float(norm):.9g}'}",
              flush=True)

if args.check:
    import ampdoctor

    said = {"check": [f.code for f in ampdoctor.check(engine, optimizer).findings],
            "check_inner": [f.code for f in ampdoctor.check(engine, optimizer.optimizer).findings],
            "details": [f.detail for f in ampdoctor.check(engine, optimizer).findings]}
    for key, repair in (("fix", lambda: ampdoctor.fix(engine)),
                        ("upcast", lambda: ampdoctor.upcast_trainable_params_(engine.module, optimizer.optimizer))):
        try:
            repair()
            said[key] = "changed"
        except ValueError as exc:
            said[key] = str(exc)
    said["dtypes"] = sorted({str(p.dtype) for p in engine.parameters()})
    print("CHECK " + json.dumps(said), flush=True)
