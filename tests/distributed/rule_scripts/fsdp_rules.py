"""Two gloo ranks on CPU: real FSDP1 / FSDP2 units, real GradScaler / ShardedGradScaler, the pre-flight rules
AMP205/AMP210/AMP211 on each, and the real 'No inf checks were recorded' of a rank that owns no shard (AMP406).

Run by tests/distributed/test_rules.py as ``RANK=r WORLD_SIZE=2 PORT=p OUT=dir python fsdp_rules.py``. Each rank
writes ``rank{r}.json``: case name -> [[code, severity, detail], ...].
"""

import json
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{os.environ['PORT']}")
warnings.simplefilter("ignore")   # FSDP1's deprecation and CPU notices

from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, ShardingStrategy, fully_shard  # noqa: E402
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: E402

from ampdoctor.core.training import TrainingSetup  # noqa: E402
from ampdoctor.explanations.crash import explain_exception  # noqa: E402
from ampdoctor.preflight.engine import run_preflight  # noqa: E402

CPU = torch.device("cpu")
results = {}


def record(name, model, scaler, codes=("AMP205", "AMP210", "AMP211")):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    found = run_preflight(TrainingSetup(model, opt, scaler), select=codes)
    results[name] = [[f.code, str(f.severity.value if hasattr(f.severity, "value") else f.severity), f.detail]
                     for f in found]


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


plain = torch.amp.GradScaler("cpu")
sharded = ShardedGradScaler(device="cpu")

# AMP210: what FSDP sums gradients in
record("fsdp1_fp16_reduce_default", FSDP(net(), mixed_precision=MixedPrecision(param_dtype=torch.float16),
                                         device_id=CPU), sharded)
record("fsdp1_fp32_reduce", FSDP(net(), mixed_precision=MixedPrecision(param_dtype=torch.float16,
                                                                       reduce_dtype=torch.float32), device_id=CPU),
       sharded)
two = net()
fully_shard(two[0], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
fully_shard(two, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
record("fsdp2_bf16_default", two, None)
two = net()
fully_shard(two, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
record("fsdp2_fp16_default_plain_scaler", two, plain)
two = net()
fully_shard(two, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))
record("fsdp2_fp32_reduce_plain_scaler", two, plain)

# AMP211: who decides to skip a step
record("fsdp1_fp32_plain_scaler", FSDP(net(), device_id=CPU), plain)
record("fsdp1_fp32_sharded_scaler", FSDP(net(), device_id=CPU), sharded)
record("fsdp1_no_shard_plain_scaler", FSDP(net(), device_id=CPU, sharding_strategy=ShardingStrategy.NO_SHARD), plain)
record("fsdp1_fp16_plain_scaler", FSDP(net(), mixed_precision=MixedPrecision(param_dtype=torch.float16,
                                                                             reduce_dtype=torch.float32),
                                       device_id=CPU), plain)

# AMP208: FSDP computes in fp16 and nothing scales the loss (pytorch/examples' FSDP T5 with use_fp16=True)
codes = ("AMP205", "AMP208")
fp16_everywhere = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)
record("fsdp1_fp16_no_scaler", FSDP(net(), mixed_precision=fp16_everywhere, device_id=CPU), None, codes)
record("fsdp1_fp16_disabled_scaler", FSDP(net(), mixed_precision=fp16_everywhere, device_id=CPU),
       ShardedGradScaler(device="cpu", enabled=False), codes)
record("fsdp1_fp16_sharded_scaler", FSDP(net(), mixed_precision=fp16_everywhere, device_id=CPU), sharded, codes)
record("fsdp1_fp32_no_scaler", FSDP(net(), device_id=CPU), None, codes)
two = net()
fully_shard(two[0], mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))
fully_shard(two, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))
record("fsdp2_fp16_no_scaler", two, None, codes)
two = net()
fully_shard(two, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
record("fsdp2_bf16_no_scaler", two, None, codes)

# AMP406: one weight, padded to 2 elements over 2 ranks: rank 1 holds only padding, so no shard of the weight
def one_step(scaler):
    torch.manual_seed(0)
    model = FSDP(nn.Linear(1, 1, bias=False), use_orig_params=True, device_id=CPU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 1)).sum()).backward()
    try:
        scaler.step(opt)
        scaler.update()
        return []
    except Exception as exc:   # the user's crash, on this rank only
        return [[f.code, "error", f.detail] for f in explain_exception(exc, TrainingSetup(model, opt, scaler))] + [
            ["raised", "", f"{type(exc).__name__}: {exc}"]]


# AMP411: an overflow in rank 0's shard only (set after backward, where an fp16 overflow would leave it); each
# rank's real scaler decides, and what its loss-scale monitor would record is written out for the merge.
def skips(scaler, steps=3):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), device_id=CPU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = {"steps": steps, "skipped_steps": [], "scale_history": []}
    for step in range(steps):
        scale = scaler.get_scale()
        if not record["scale_history"] or record["scale_history"][-1][1] != scale:
            record["scale_history"].append([step, scale])
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if step == 1 and rank == 0:
            next(model.parameters()).grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < scale:
            record["skipped_steps"].append(step)
        opt.zero_grad()
    return record


results["skips_plain_scaler"] = skips(torch.amp.GradScaler("cpu"))
results["skips_sharded_scaler"] = skips(ShardedGradScaler(device="cpu"))
results["no_shard_sharded_scaler"] = one_step(ShardedGradScaler(device="cpu"))   # both ranks join its all-reduce
results["no_shard_plain_scaler"] = one_step(torch.amp.GradScaler("cpu"))        # no collective after this
with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
dist.barrier()  # no rank tears gloo down while the other is still in a collective
dist.destroy_process_group()
