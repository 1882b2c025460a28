"""FSDP training as the public examples write it, on gloo (CPU); run under torchrun.

python -m torch.distributed.run --nproc-per-node 2 fsdp_train.py MODE [STEPS]

MODE:
    fsdp1   ``FullyShardedDataParallel`` with ``MixedPrecision(param_dtype=fp16, reduce_dtype=fp16)``, a
            ``ShardedGradScaler`` and FSDP's own ``model.clip_grad_norm_`` after ``scaler.unscale_``, as in the
            PyTorch FSDP tutorial's T5 fine-tuning (pytorch/examples, distributed/FSDP)
    fsdp2   ``fully_shard`` per block and on the root with ``MixedPrecisionPolicy(param_dtype=bf16,
            reduce_dtype=fp32)`` and ``torch.nn.utils.clip_grad_norm_`` on the DTensor gradients, as in
            pytorch/examples distributed/FSDP2 and torchtitan
"""

import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

mode = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 12
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)],
                      nn.Linear(32, 8))
scaler = None
if mode == "fsdp1":
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # FSDP on CPU warns about device_id
        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), mixed_precision=MixedPrecision(
            param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16))
    scaler = ShardedGradScaler("cpu")
else:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
torch.manual_seed(1 + dist.get_rank())
for step in range(steps):
    x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))
    loss = nn.functional.cross_entropy(model(x).float(), y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        model.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    opt.zero_grad()
print(f"rank {dist.get_rank()} done, loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
