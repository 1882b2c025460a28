"""An encoder and a decoder of one class, local to main() as most scripts keep them; one parameter is left out of
the optimizer (AMP302), so the pre-flight at the first step names a module of the decoder.

    python models_in_main.py [list|wrapped]

``list`` keeps the two models in a list at module level (``models[0]``, ``models[1]``) instead; ``wrapped`` binds
module-level names to their DataParallel wrappers (``encoder = DataParallel(build())``), as DDP scripts do.
"""
import sys

import torch
from torch import nn


def build():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def main():
    torch.manual_seed(0)
    encoder, decoder = build(), build()
    train(encoder, decoder)


def train(enc, dec):
    opt = torch.optim.AdamW([*enc.parameters(), *list(dec.parameters())[:3]], lr=1e-3)   # not the last bias
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(16, 8)
    for step in range(4):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (dec(enc(x)).float() - x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


if __name__ == "__main__":
    if sys.argv[1:] == ["list"]:
        torch.manual_seed(0)
        models = [build(), build()]
        train(*models)
    elif sys.argv[1:] == ["wrapped"]:
        torch.manual_seed(0)
        encoder, decoder = nn.DataParallel(build()), nn.DataParallel(build())
        train(encoder, decoder)
    else:
        main()
