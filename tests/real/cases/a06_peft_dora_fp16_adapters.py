# source: https://github.com/huggingface/peft/issues/1249 (failures.md row 2; DoRA variant)
# reproduces: DoRA (use_dora=True) adapters created in the dtype of an fp16 base (autocast_adapter_dtype=False):
#   lora_A/B and the magnitude vector are fp16 -> ValueError: Attempting to unscale FP16 gradients.
# expect: AMP101
# expect-detail: AMP101 lora_magnitude_vector
# fix: finishes
import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertForSequenceClassification

torch.manual_seed(0)
cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, num_labels=2)
base = BertForSequenceClassification(cfg).to(torch.float16)
model = get_peft_model(base, LoraConfig(r=4, target_modules=["query", "value"], use_dora=True),
                       autocast_adapter_dtype=False)
opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
ids, labels = torch.randint(0, 100, (8, 12)), torch.randint(0, 2, (8,))
for step in range(5):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=labels).loss
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss), f"non-finite loss at step {step}"
    print(f"step {step} loss {loss.item():.4f}")
