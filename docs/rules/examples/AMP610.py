"""Some batches hold NaN features, and the transformers Trainer logs a finite loss anyway: with
``logging_nan_inf_filter=True`` (its default) it puts the average of the earlier losses in place of a NaN one."""
# command: python {script}
import os
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else deepspeed (which accelerate imports) logs a dated warning
import torch
from torch import nn
from transformers import PrinterCallback, Trainer, TrainingArguments

from ampdoctor.integrations.transformers import AmpDoctorCallback


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": nn.functional.mse_loss(self.net(x).squeeze(-1).float(), labels)}


torch.manual_seed(0)
data = [{"x": torch.randn(4), "labels": torch.tensor(float(i % 3))} for i in range(32)]
for sample in data[8:16]:
    sample["x"][0] = float("nan")  # the second batch: a missing reading stored as NaN
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, use_cpu=True, bf16=True, max_steps=4, per_device_train_batch_size=8,
                             logging_steps=1, train_sampling_strategy="sequential", report_to=[],
                             save_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(model=Regressor(), args=args, train_dataset=data, callbacks=[AmpDoctorCallback()])
    trainer.remove_callback(PrinterCallback)  # its last line holds the run time; the losses are printed below
    trainer.train()
print("logged losses:", [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h])
