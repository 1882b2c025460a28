# source: https://github.com/huggingface/peft/issues/1249
# also: https://github.com/huggingface/peft/pull/1336 , https://github.com/huggingface/peft/pull/1706
#   (failures.md row 2)
# reproduces: a base model in fp16 and LoRA adapters created in the base dtype (peft < 0.11 behaviour, today
#   autocast_adapter_dtype=False), fp16 AMP -> ValueError: Attempting to unscale FP16 gradients.
# expect: AMP101
# fix: finishes
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
base = LlamaForCausalLM(cfg).to(torch.float16)
model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                       autocast_adapter_dtype=False)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-4)
scaler = torch.amp.GradScaler("cpu")
ids = torch.randint(0, 128, (4, 16))
for step in range(5):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss), f"non-finite loss at step {step}"
    print(f"step {step} loss {loss.item():.4f}")
