# source: https://github.com/huggingface/transformers/issues/23165
# also: https://github.com/huggingface/accelerate/issues/1778 (failures.md row 1)
# reproduces: a causal LM created with torch_dtype=torch.float16 (tiny LlamaConfig, no download), trained with
#   fp16 autocast + GradScaler and gradient clipping as Trainer/accelerate do -> ValueError at scaler.unscale_
# expect: AMP101
# fix: finishes
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float16)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
ids = torch.randint(0, 128, (4, 16))
for step in range(5):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # what accelerator.clip_grad_norm_ / Trainer clipping do
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss), f"non-finite loss at step {step}"
    print(f"step {step} loss {loss.item():.4f}")
