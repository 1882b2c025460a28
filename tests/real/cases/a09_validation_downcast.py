# source: https://github.com/huggingface/diffusers/issues/13124
# also: https://github.com/huggingface/diffusers/pull/13895 (failures.md row 5)
# reproduces: fp32 LoRA adapters on an fp16 base train fine; a validation step moves the live model with
#   .to(dtype=torch.float16), which downcasts the adapters -> the first optimizer step after validation raises
#   ValueError: Attempting to unscale FP16 gradients.
# expect: AMP101
# fix: finishes
import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertModel

torch.manual_seed(0)
cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
model = get_peft_model(BertModel(cfg).to(torch.float16), LoraConfig(r=4, target_modules=["query", "value"]))
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
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
    assert torch.isfinite(loss), f"non-finite loss at step {step}"
    print(f"step {step} loss {loss.item():.4f}")
    if step == 2:  # log_validation(): pipeline.to(device, dtype=weight_dtype) on the live model
        model.eval()
        with torch.no_grad():
            model.to(device="cpu", dtype=torch.float16)
            model(input_ids=ids[:2])
        model.train()
