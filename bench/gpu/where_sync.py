"""Print where each host sync of a guarded CUDA AMP loop comes from (set_sync_debug_mode('warn'))."""
import collections, traceback, warnings
import torch
from torch import nn
from ampdoctor.core.training import TrainingSetup
from ampdoctor.guard.scaler_guard import ScalerGuard

sites = collections.Counter()
def show(message, category, filename, lineno, file=None, line=None):
    if "called a synchronizing CUDA operation" in str(message):
        stack = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]]
        sites[" <- ".join(reversed(stack[-5:]))] += 1
warnings.showwarning = show
for guarded in (False, True):
    sites.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda")
    guard = ScalerGuard(scaler, TrainingSetup(model, opt, scaler)).attach() if guarded else None
    x = torch.randn(4, 8, device="cuda")
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    for _ in range(10):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    torch.cuda.set_sync_debug_mode(0)
    print("guarded" if guarded else "plain", sum(sites.values()))
    for s, n in sites.most_common(6):
        print(f"  {n}x {s}")
