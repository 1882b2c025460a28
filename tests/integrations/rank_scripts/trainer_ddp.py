"""A tiny transformers ``Trainer.train()`` on two CPU processes (gloo), ``bf16=True``, with ampdoctor's callback.

python -m torch.distributed.run --nproc-per-node 2 trainer_ddp.py MODE OUT

OUT: the folder for ``report.json``, the ``logs`` folder and the Trainer's output.
MODE:
    seed    a stray ``.half()`` on the classifier, on every rank: trainable float16 parameters on both ranks
    crash1  rank 1 alone raises a RuntimeError in its forward at step 2
"""

import os
import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from ampdoctor.integrations.transformers import AmpDoctorCallback

STEPS = 4


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 2 * 4 * STEPS

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": torch.tensor(i % 2)}


def crash_at_step_2(module, args):
    """A forward pre-hook on rank 1's encoder: the third forward (step 2) raises."""
    module.calls = getattr(module, "calls", 0) + 1
    if module.calls == 3:
        raise RuntimeError("rank 1 broke at step 2")


MODE, OUT = sys.argv[1:3]
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                 num_attention_heads=2, intermediate_size=32,
                                                 max_position_embeddings=16, num_labels=2))
if MODE == "seed":
    model.classifier.half()   # the stray cast, on every rank
if MODE == "crash1" and int(os.environ["RANK"]) == 1:
    model.bert.register_forward_pre_hook(crash_at_step_2)
args = TrainingArguments(output_dir=f"{OUT}/out", use_cpu=True, bf16=True, max_steps=STEPS,
                         per_device_train_batch_size=4, report_to=[], save_strategy="no", logging_steps=1,
                         disable_tqdm=True, seed=0, ddp_backend="gloo")
callback = AmpDoctorCallback(json_path=f"{OUT}/report.json", log_dir=f"{OUT}/logs", every=1)
Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback]).train()
print(f"train done on rank {os.environ['RANK']}", flush=True)
