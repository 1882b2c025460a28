#!/usr/bin/env bash
# Second device run: where the guard syncs on CUDA, and what the Lightning callback's AMP608 saw.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
d=$(mktemp -d)
{
python3 - <<'PY'
import traceback, torch
from torch import nn
import ampdoctor.guard.scaler_guard as sg
from ampdoctor.core.training import TrainingSetup
orig = sg.ScalerGuard._on_error
def on_error(self, exc):
    traceback.print_exception(exc, limit=-6)
    return orig(self, exc)
sg.ScalerGuard._on_error = on_error
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cuda")
sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.99)
guard = sg.ScalerGuard(scaler, TrainingSetup(model, opt, scaler)).attach()
x = torch.randn(4, 8, device="cuda")
for i in range(40):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    scaler.step(opt)   # torch's own .item() here
    torch.cuda.set_sync_debug_mode("error")
    try:
        scaler.update()
        sched.step()
        opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode(0)
print("guard findings:", [(f.code, f.detail[:200]) for f in guard.findings()])
PY
cd $d && timeout 120 python3 $OLDPWD/examples/lightning_callback.py --fix --json l2.json > l.out 2>&1; echo "exit $?"
python3 - <<'PY'
import json
r = json.load(open("l2.json"))
for f in r["findings"]:
    print(f["code"], f["severity"], f.get("step"), f["where"], "|", f["detail"][:400])
w = r.get("watch") or {}
print("scale:", json.dumps(w.get("scale"))[:600])
print("formats:", w.get("formats"), "steps", w.get("steps"))
PY
grep -n "scaler\|GradScaler\|precision" l.out | head -5
} 2>&1 | tee ${OUT:-/tmp}/diag.log
