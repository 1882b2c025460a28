"""One Lightning training, to be diagnosed through each of ampdoctor's entry points in turn.

python entry_points.py plain|fix [attach|callback]

The model's head was left in float16 by a stray ``.half()`` and trains without autocast: its weights are updated in
half precision (AMP103) and lose updates to rounding (AMP607). ``fix`` asks for the repair (fp32 master weights).
With ``attach`` the script calls ``ampdoctor.attach()`` first; with ``callback`` it gives the Trainer
``AmpDoctorCallback``; without either, ampdoctor comes from outside (``ampdoctor run``, ``AMPDOCTOR=...``, the
notebook extension running this file with ``%run``). Lightning's own log lines are kept quiet, so that what is
printed is ampdoctor's.
"""

import logging
import sys
import warnings

import torch
from torch import nn

STEPS = 12


def main(fix: bool, how: str) -> None:
    if how == "attach":
        import ampdoctor

        ampdoctor.attach(fix=fix)
    warnings.filterwarnings("ignore")   # tqdm's in a notebook kernel, Lightning's own
    import lightning as L

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            self.head = nn.Linear(16, 1).half()   # the stray cast

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.head(self.encoder(x).half()).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    callbacks = []
    if how == "callback":
        from ampdoctor.integrations.lightning import AmpDoctorCallback

        callbacks.append(AmpDoctorCallback(fix=fix))
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=8))


if __name__ == "__main__":
    torch.manual_seed(0)
    main(sys.argv[1] == "fix", sys.argv[2] if len(sys.argv) > 2 else "")
    print("done", flush=True)
