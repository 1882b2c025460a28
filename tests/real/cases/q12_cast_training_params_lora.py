# source: https://github.com/huggingface/diffusers/pull/6119 (failures.md row 3: upcast only the trainable LoRA
#   params after injection, later diffusers.training_utils.cast_training_params)
# reproduces: nothing - frozen fp16 model, LoRA injected with peft (fp16), then every requires_grad parameter
#   upcast to fp32; fp16 autocast + GradScaler + clipping.
# expect: quiet
import torch
from peft import LoraConfig, inject_adapter_in_model
from transformers import BertConfig, BertModel

torch.manual_seed(0)
cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
model = BertModel(cfg).requires_grad_(False).to(torch.float16)
inject_adapter_in_model(LoraConfig(r=4, target_modules=["query", "value"]), model)
for p in model.parameters():  # cast_training_params(model, dtype=torch.float32)
    if p.requires_grad:
        p.data = p.data.float()
params = [p for p in model.parameters() if p.requires_grad]
opt, scaler = torch.optim.AdamW(params, lr=1e-3), torch.amp.GradScaler("cpu")
ids, target = torch.randint(0, 100, (8, 12)), torch.randn(8, 32)
for step in range(6):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(input_ids=ids).last_hidden_state[:, 0].float(), target)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss)
print(f"final loss {loss.item():.4f}")
