# source: failures.md row 39 (huggingface/trl PR #7272: "DoRA magnitude frozen with no error"; no URL given there)
# reproduces: QLoRA-style cast of every trainable parameter to bf16 after get_peft_model (the TRL convention) on a
#   bf16 base with bf16 autocast: the DoRA magnitude vector (~0.1) gets AdamW steps of ~1e-4, below half a bf16
#   ulp, so it never moves and no error is raised.
# expect: AMP607
# fix: finishes
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = get_peft_model(LlamaForCausalLM(cfg).to(torch.bfloat16),
                       LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True))
for p in model.parameters():  # "cast trainable params to bf16" as TRL does for quantized/QLoRA models
    if p.requires_grad:
        p.data = p.data.to(torch.bfloat16)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
mags = {n: p.detach().clone() for n, p in model.named_parameters() if "magnitude" in n}
ids = torch.randint(0, 128, (4, 16))
for step in range(8):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"final loss {loss.item():.4f}")
params = dict(model.named_parameters())
if all(torch.equal(params[n].detach(), v) for n, v in mags.items()):
    sys.exit(f"SYMPTOM: none of the {len(mags)} DoRA magnitude vectors moved in 8 steps")
