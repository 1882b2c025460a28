"""One small training, by Lightning or by the transformers Trainer, run plainly or with ampdoctor's callback.

python same_as_run.py lightning|trainer|trainer-flags [CALLBACK_JSON]

The model has a head cast to float16 by a stray ``.half()`` and trains in fp32 otherwise, with no autocast: the
head's weights are updated in half precision (AMP103) and lose updates to rounding (AMP607). With CALLBACK_JSON the
framework's ``AmpDoctorCallback(json_path=CALLBACK_JSON)`` is attached; without it, the test runs the script under
``ampdoctor run``. Both must say the same.

``trainer-flags``: the Trainer with ``bf16=True`` (which asks for fp32 weights: AMP209 on the half head) and a batch
of NaN inputs at step 2, whose NaN losses ``logging_nan_inf_filter`` (on by default) keeps out of the log (AMP610).
"""

import sys

import torch
from torch import nn

STEPS = 12


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g)


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1).half()   # the stray cast

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(self.encoder(x).half()).float(), y)


def train_lightning(callback_json: str | None) -> None:
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = Body()

        def training_step(self, batch, batch_idx):
            return self.body.loss(*batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    callbacks = []
    if callback_json:
        from ampdoctor.integrations.lightning import AmpDoctorCallback

        callbacks.append(AmpDoctorCallback(json_path=callback_json))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=8)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), loader)


def train_trainer(callback_json: str | None, flags: bool = False) -> None:
    from transformers import Trainer, TrainingArguments

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = Body()

        def forward(self, inputs, labels):
            return {"loss": self.body.loss(inputs, labels)}

    rows = [{"inputs": a, "labels": b} for a, b in zip(*data())]
    if flags:   # step 2's batch: NaN features
        for row in rows[16:24]:
            row["inputs"] = torch.full_like(row["inputs"], float("nan"))
    callbacks = []
    if callback_json:
        from ampdoctor.integrations.transformers import AmpDoctorCallback

        callbacks.append(AmpDoctorCallback(json_path=callback_json))
    args = TrainingArguments("out", max_steps=STEPS, per_device_train_batch_size=8, learning_rate=1e-3,
                             optim="sgd", lr_scheduler_type="constant", report_to=[], use_cpu=True,
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                             bf16=flags, train_sampling_strategy="sequential")
    Trainer(Model(), args, train_dataset=rows, callbacks=callbacks).train()


if __name__ == "__main__":
    torch.manual_seed(0)
    callback = sys.argv[2] if len(sys.argv) > 2 else None
    if sys.argv[1] == "trainer-flags":
        train_trainer(callback, flags=True)
    else:
        {"lightning": train_lightning, "trainer": train_trainer}[sys.argv[1]](callback)
    print("done", flush=True)
