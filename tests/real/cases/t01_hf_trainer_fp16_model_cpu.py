# source: https://github.com/huggingface/transformers/issues/23165 (failures.md row 1)
# reproduces: a model created with torch_dtype=torch.float16 (tiny BertConfig, no download) and
#   Trainer(fp16=True) - here on CPU (use_cpu=True), where accelerate quietly creates no GradScaler and no autocast
#   while still reporting mixed_precision='fp16': instead of the GPU's ValueError the run is pure fp16 training
#   with fp16 AdamW state, whose exp_avg_sq underflows: steps of ~lr/eps instead of ~lr blow the weights up.
# expect: AMP203 AMP103
# fix: finishes
import sys
import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

torch.manual_seed(0)
cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
model = BertForSequenceClassification(cfg).to(torch.float16)  # from_pretrained(..., torch_dtype=torch.float16)
data = [{"input_ids": torch.randint(0, 100, (12,)), "labels": torch.tensor(i % 2)} for i in range(32)]
gain = model.bert.embeddings.LayerNorm.weight.detach().clone()
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, use_cpu=True, fp16=True, max_steps=8, learning_rate=2e-4,
                             per_device_train_batch_size=4, report_to=[], save_strategy="no", logging_steps=4,
                             disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data).train()
moved = (model.bert.embeddings.LayerNorm.weight.detach().float() - gain.float()).abs().max().item()
print(f"LayerNorm gain moved by {moved:.3g} in 8 AdamW steps of lr 2e-4")
if moved > 10 * 8 * 2e-4:  # Adam moves a weight by about lr per step
    sys.exit(f"SYMPTOM: pure-fp16 AdamW steps blew up: a LayerNorm gain moved by {moved:.3g} in 8 steps of lr 2e-4")
