# source: https://github.com/huggingface/transformers/issues/23165 (failures.md row 1: load the model in fp32 and
#   let mixed precision do the half compute) and https://github.com/huggingface/accelerate/pull/1036 (no scaler
#   for bf16)
# reproduces: nothing - a tiny fp32 BertForSequenceClassification (from a config) trained by the transformers
#   Trainer with bf16=True on CPU (bf16 autocast, no GradScaler).
# expect: quiet
import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

torch.manual_seed(0)
cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
model = BertForSequenceClassification(cfg)
data = [{"input_ids": torch.randint(0, 100, (12,)), "labels": torch.tensor(i % 2)} for i in range(32)]
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, use_cpu=True, bf16=True, max_steps=6, learning_rate=2e-4,
                             per_device_train_batch_size=4, report_to=[], save_strategy="no", logging_steps=3,
                             disable_tqdm=True)
    result = Trainer(model=model, args=args, train_dataset=data).train()
assert result.training_loss == result.training_loss  # not NaN
print(f"train loss {result.training_loss:.4f}")
