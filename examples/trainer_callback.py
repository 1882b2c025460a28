"""A tiny BertForSequenceClassification trained by the transformers Trainer with ampdoctor's callback.

The model is built from a config (no download). ``--half`` loads it "in half precision" (``model.half()``, what
``from_pretrained(..., dtype=torch.float16)`` gives) while ``TrainingArguments(fp16=True)`` asks for fp32 weights
with fp16 autocast: the callback flags it before the first step. ``max_grad_norm`` clips; the callback reports the
gradient norm before clipping.

    python examples/trainer_callback.py                  # bf16 on CPU: a clean run, the watch's summary
    python examples/trainer_callback.py --half           # fp16=True on a half model: AMP209 (and AMP203 on CPU)
    python examples/trainer_callback.py --half --fix     # the trainable weights are upcast before the first step
"""
import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from ampdoctor.integrations.transformers import AmpDoctorCallback

cli = argparse.ArgumentParser()
cli.add_argument("--half", action="store_true", help="a half-precision model with fp16=True")
cli.add_argument("--fix", action="store_true", help="upcast trainable half parameters before the first step")
cli.add_argument("--steps", type=int, default=12)
cli.add_argument("--max-grad-norm", type=float, default=0.5)
cli.add_argument("--json", default="ampdoctor-trainer.json", help="where the callback writes its report")
cli.add_argument("--out", default="trainer-out", help="the Trainer's output_dir (nothing is saved)")
args = cli.parse_args()


class Tokens(torch.utils.data.Dataset):
    """Label 1 when the sequence holds more even than odd token ids."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": torch.tensor(int((ids % 2 == 0).sum() > 8))}


torch.manual_seed(0)
config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    max_position_embeddings=32, num_labels=2)
model = BertForSequenceClassification(config)
if args.half:
    model = model.half()
training = TrainingArguments(output_dir=args.out, use_cpu=not torch.cuda.is_available(), max_steps=args.steps,
                             per_device_train_batch_size=16, learning_rate=1e-3, max_grad_norm=args.max_grad_norm,
                             fp16=args.half, bf16=not args.half, logging_steps=4, save_strategy="no", report_to=[],
                             disable_tqdm=True, seed=0)
trainer = Trainer(model=model, args=training, train_dataset=Tokens(),
                  callbacks=[AmpDoctorCallback(json_path=args.json, fix=args.fix)])
trainer.train()
print(f"trained {trainer.state.global_step} steps; report written to {args.json}")
