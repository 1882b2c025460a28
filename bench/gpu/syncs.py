"""set_sync_debug_mode('error') around the watch's non-sampled steps, the guard with a scheduler, and MasterWeights;
sync counts on sampled steps; overhead of the watch on a GPT-2-small-sized fp16 model."""
import time
import warnings

import torch
from torch import nn

import ampdoctor
from ampdoctor.core.training import TrainingSetup
from ampdoctor.guard.scaler_guard import ScalerGuard


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()


def amp_step(model, opt, scaler, x, y, sched=None):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)


def count_syncs(fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in seen)


def check(name, fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        print(f"PASS {name}: no host sync under set_sync_debug_mode('error')")
    except RuntimeError as exc:
        torch.cuda.set_sync_debug_mode(0)
        print(f"FAIL {name}: {str(exc).splitlines()[0]}")


x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")
# 1. the watch: sampled steps 0-9 (dense), then every 50th; steps 10..49 are not sampled
model = mlp()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
scaler = torch.amp.GradScaler("cuda")
with ampdoctor.watch(model, opt, scaler, every=50) as w:
    per_step = [count_syncs(lambda: amp_step(model, opt, scaler, x, y)) for _ in range(12)]
    print("syncs per step, watch attached, steps 0-11 (0-9 sampled):", per_step)
    check("watch, 20 non-sampled steps", lambda: [amp_step(model, opt, scaler, x, y) for _ in range(20)])
base = mlp()
bopt = torch.optim.AdamW(base.parameters(), lr=1e-3, fused=True)
bscaler = torch.amp.GradScaler("cuda")
print("syncs per step without ampdoctor:", [count_syncs(lambda: amp_step(base, bopt, bscaler, x, y)) for _ in range(4)])
# 2. the guard with a scheduler
model = mlp()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
scaler = torch.amp.GradScaler("cuda")
sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.99)
with ScalerGuard(scaler, TrainingSetup(model, opt, scaler)) as guard:
    amp_step(model, opt, scaler, x, y, sched)
    check("guard + StepLR, 40 steps", lambda: [amp_step(model, opt, scaler, x, y, sched) for _ in range(40)])
print("guard findings:", [f.code for f in guard.findings()])
# 3. MasterWeights over a half model
model = mlp().half()
opt = ampdoctor.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
scaler = torch.amp.GradScaler("cuda")
amp_step(model, opt, scaler, x, y)
check("MasterWeights + GradScaler, 20 steps", lambda: [amp_step(model, opt, scaler, x, y) for _ in range(20)])

# 4. overhead on a GPT-2-small-sized model (124M), fp16 autocast + GradScaler + fused AdamW
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


def gpt2_ms(mode, steps=30):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    ids = torch.randint(0, 50257, (8, 512), device="cuda")
    w = None if mode == "off" else ampdoctor.watch(model, opt, scaler, every=50 if mode == "default" else 1)

    def step():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    for _ in range(12):  # past the 10 dense steps
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / steps * 1e3
    if w is not None:
        w.detach()
    return ms


for _ in range(2):
    off, default, every1 = gpt2_ms("off"), gpt2_ms("default"), gpt2_ms("every1")
    print(f"GPT-2 small fp16, batch 8x512: {off:.1f} ms/step without; watch(every=50) {default:.1f} ms "
          f"({default / off:.3f}x); watch(every=1) {every1:.1f} ms ({every1 / off:.3f}x)")
