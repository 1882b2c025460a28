"""A loop under a tqdm bar, as a script's own progress display draws it: an fp16 model with a GradScaler under fp16
autocast (AMP101), so that ``ampdoctor run --fix`` upcasts it at the first step, while the bar is open.

``--child`` runs the same loop in a child Python process instead (ampdoctor's child hook prints its lines there).
"""

import subprocess
import sys

import torch
from torch import nn
from tqdm import tqdm


def train(steps: int = 30) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    for _ in tqdm(range(steps), desc="train", mininterval=0):  # redrawn every step, piped too
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        subprocess.run([sys.executable, __file__], check=True)
    else:
        train()
