# source: https://github.com/huggingface/peft/issues/341 (failures.md row 8)
# reproduces: modules_to_save=["classifier"] on an fp16 base: peft keeps the LoRA weights in fp32 by default
#   (autocast_adapter_dtype=True) but the trainable copy of the classifier stays fp16
#   -> ValueError: Attempting to unscale FP16 gradients.
# expect: AMP101
# expect-detail: AMP101 modules_to_save
# fix: finishes
import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertForSequenceClassification

torch.manual_seed(0)
cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, num_labels=3)
base = BertForSequenceClassification(cfg).to(torch.float16)
model = get_peft_model(base, LoraConfig(r=4, target_modules=["query", "value"], modules_to_save=["classifier"]))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
ids, labels = torch.randint(0, 100, (8, 12)), torch.randint(0, 3, (8,))
for step in range(5):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=labels).loss
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss), f"non-finite loss at step {step}"
    print(f"step {step} loss {loss.item():.4f}")
