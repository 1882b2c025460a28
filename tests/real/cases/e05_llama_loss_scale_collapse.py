# source: https://github.com/deepspeedai/DeepSpeed/issues/4017
# also: https://github.com/deepspeedai/DeepSpeedExamples/issues/418 (failures.md row 26)
# reproduces: a bf16-pretrained LLM (tiny LlamaConfig, MLP down_proj with bf16-range weights) trained with fp16
#   and dynamic loss scaling: every step overflows in the forward, the scale halves until it is below 1
#   (DeepSpeed: "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.").
# expect: AMP603
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(cfg)
with torch.no_grad():
    model.model.layers[1].mlp.up_proj.weight.mul_(5000.0)  # MLP activations ~9e4, fine in bf16, > 65504
    model.model.layers[1].mlp.down_proj.weight.mul_(5000.0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
ids = torch.randint(0, 128, (2, 16))
for step in range(20):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    if scaler.get_scale() < 1:
        sys.exit(f"SYMPTOM: OVERFLOW at every step ({step + 1} skipped); loss scale {scaler.get_scale():g} < 1: "
                 "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
