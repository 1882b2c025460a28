"""A model loaded in half precision (``from_pretrained(..., dtype=torch.float16)``, here a tiny classifier made with
``.half()``) is trained by the Trainer with ``fp16=True``, which expects fp32 weights under fp16 autocast."""
# command: python {script}
import os
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # keeps DeepSpeed's timestamped "no GPU" warning off the page
import torch
from torch import nn
from transformers import PrinterCallback, Trainer, TrainingArguments

from ampdoctor.integrations.transformers import AmpDoctorCallback


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.EmbeddingBag(100, 32), nn.Linear(32, 2)

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids)).float()
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


torch.manual_seed(0)
model = Classifier().half()  # the mistake: half weights
data = [{"input_ids": torch.randint(0, 100, (12,)), "labels": torch.tensor(i % 2)} for i in range(16)]
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, use_cpu=True, fp16=True, max_steps=4, per_device_train_batch_size=4,
                             report_to=[], save_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[AmpDoctorCallback()])
    trainer.remove_callback(PrinterCallback)  # its log lines carry timings
    trainer.train()
