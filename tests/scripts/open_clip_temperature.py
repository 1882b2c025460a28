"""open_clip's learned temperature in pure bf16, clamped after every optimizer step; prints it after each step.

Re-created in our own words (no code copied) from mlfoundations/open_clip at
89fb801f1e6087880e951fc8354b8a2077b79c6d: src/open_clip_train/legacy_train.py (last changed in bfb1975131e8) and
src/open_clip/model.py. What it keeps: a CLIP-like model whose ``logit_scale`` parameter starts at log(1 / 0.07) and
multiplies the normalised image-text similarities by its exp; the symmetric cross-entropy loss; AdamW with betas
(0.9, 0.98), eps 1e-6 and weight decay on the 2-D weights only (``logit_scale``, biases and gains excluded);
``--precision pure_bf16``, which casts the whole model to bf16 with no autocast and no scaler; and, after every
optimizer step, ``logit_scale.clamp_(0, math.log(100))`` under ``no_grad``. Tiny random images and token ids.
Argument ``fp32``: train in float32 from the same (bf16) start, the reference.
"""
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn


class TinyClip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.visual = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 8))
        self.token_embedding = nn.Embedding(50, 8)
        self.ln_final = nn.LayerNorm(8)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def forward(self, images, texts):
        image_features = F.normalize(self.visual(images), dim=-1)
        text_features = F.normalize(self.ln_final(self.token_embedding(texts).mean(1)), dim=-1)
        return image_features, text_features, self.logit_scale.exp()


def contrastive_loss(image_features, text_features, logit_scale):
    logits_per_image = logit_scale * image_features @ text_features.T
    labels = torch.arange(len(logits_per_image))
    return (F.cross_entropy(logits_per_image.float(), labels)
            + F.cross_entropy(logits_per_image.T.float(), labels)) / 2


torch.manual_seed(0)
model = TinyClip().to(torch.bfloat16)   # pure_bf16
dtype = torch.float32 if sys.argv[1:] == ["fp32"] else torch.bfloat16
model.to(dtype)
named = list(model.named_parameters())
decay = [p for n, p in named if p.ndim >= 2 and "logit_scale" not in n]
no_decay = [p for n, p in named if not (p.ndim >= 2 and "logit_scale" not in n)]
opt = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.2}],
                        lr=5e-3, betas=(0.9, 0.98), eps=1e-6)
g = torch.Generator().manual_seed(1)
images, texts = torch.randn(16, 12, generator=g), torch.randint(0, 50, (16, 5), generator=g)
for step in range(8):
    loss = contrastive_loss(*model(images.to(dtype), texts))
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        model.logit_scale.clamp_(0, math.log(100))
    print(f"step {step} logit_scale {model.logit_scale.item():.6f} temperature {model.logit_scale.exp().item():.3f}")
