# source: https://github.com/huggingface/transformers/issues/34053 (failures.md row 36: the fix, transformers
#   PR #11663 "Save scaler state dict when checkpointing")
# reproduces: nothing - the checkpoint holds model, optimizer and GradScaler state; the restarted run loads all
#   three and continues at the settled scale without skipping steps.
# expect: quiet
import torch
from torch import nn


def build():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), torch.amp.GradScaler("cpu")


def train(model, opt, scaler, steps):
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).sum()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


torch.manual_seed(0)
x = torch.randn(64, 16)
model, opt, scaler = build()
train(model, opt, scaler, 10)
torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, "ckpt.pt")
model, opt, scaler = build()
ckpt = torch.load("ckpt.pt")
model.load_state_dict(ckpt["model"])
opt.load_state_dict(ckpt["opt"])
scaler.load_state_dict(ckpt["scaler"])
train(model, opt, scaler, 8)
print(f"resumed at scale {ckpt['scaler']['scale']:g}, now {scaler.get_scale():g}")
