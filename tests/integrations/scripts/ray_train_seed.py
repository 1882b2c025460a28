"""Ray Train's ``TorchTrainer`` (two CPU workers, gloo) whose worker function runs inside ``ampdoctor.attach()``.

Written for the tests (tests/integrations/test_ray.py). Arguments: a folder, then one or more runs, each
``MODE``, ``MODE:plain`` or ``MODE:bare``, trained one after the other in one Ray session (its start-up is most of
the time):

- ``seed``: the seed error: a ``.half()`` model, fp16 autocast on CPU, ``GradScaler("cpu")``, wrapped in DDP by
  ``ray.train.torch.prepare_model``; the first ``scaler.step`` raises "Attempting to unscale FP16 gradients".
- ``amp``: the same loop with fp32 weights (correct AMP): it trains.

``with ampdoctor.attach(json_path=FOLDER/RUN/report.json, log_dir=FOLDER/RUN/logs)`` wraps the loop (RUN: the run
with ``-`` for ``:``); ``:plain`` calls ``attach(...)`` without ``with`` and ends it with ``handle.end()``; ``:bare``
calls ``attach(...)`` alone, as at the top of a script, whose report is due at the process's exit, which a Ray worker
never reaches (Ray kills it); its ranks meet in ``FOLDER/RUN/exchange``, which they leave behind. Each worker prints
``ray_train_seed: RUN rank R`` first, so its lines (prefixed by Ray with its pid) can be told apart; after each
``fit`` the driver prints ``ray_train_seed: RUN ok`` or ``ray_train_seed: RUN failed: <error type>``. The exit
status is 1 when a fit failed, else 0.
"""

import os
import sys
from collections import OrderedDict

os.environ.setdefault("RAY_ADDRESS", "local")   # never look for a cluster

import ray  # noqa: E402
import torch  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402


def train(config: dict) -> None:
    import ampdoctor

    rank = ray.train.get_context().get_world_rank()
    mode, plain, run = config["mode"], config["plain"], config["run"]
    print(f"ray_train_seed: {run} rank {rank}", flush=True)
    out = os.path.join(config["folder"], run)
    os.makedirs(out, exist_ok=True)
    options = dict(json_path=os.path.join(out, "report.json"), log_dir=os.path.join(out, "logs"), every=1)
    if plain == "bare":   # what a user may write: the report is due at the process's exit
        # the ranks meet in a folder of the run's own: the killed workers leave it behind (not in the temp dir)
        os.environ["AMPDOCTOR_RANK_DIR"] = os.path.join(out, "exchange")
        ampdoctor.attach(**options)
        _loop(mode)
    elif plain:
        handle = ampdoctor.attach(**options)
        try:
            _loop(mode)
        finally:
            handle.end()
    else:
        with ampdoctor.attach(**options):
            _loop(mode)


def _loop(mode: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(fc1=torch.nn.Linear(8, 16), act=torch.nn.ReLU(),
                                            head=torch.nn.Linear(16, 2)))
    if mode == "seed":
        model = model.half()   # the seed error: trainable fp16 weights under the GradScaler
    model = ray.train.torch.prepare_model(model, move_to_device=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    torch.manual_seed(1 + ray.train.get_context().get_world_rank())
    for _ in range(4):
        x, y = torch.randn(16, 8), torch.randn(16, 2)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def main(folder: str, runs: list[str]) -> int:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    status = 0
    for run in runs:
        mode, _, plain = run.partition(":")
        run = run.replace(":", "-")
        trainer = TorchTrainer(train, train_loop_config={"mode": mode, "plain": plain, "run": run, "folder": folder},
                               scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                               torch_config=TorchConfig(backend="gloo"),
                               run_config=RunConfig(name=f"ray_train_seed_{run}",
                                                    storage_path=os.path.join(folder, "ray_results")))
        try:
            trainer.fit()
        except Exception as exc:  # TrainingFailedError: a worker raised
            print(f"ray_train_seed: {run} failed: {type(exc).__name__}", flush=True)
            status = 1
        else:
            print(f"ray_train_seed: {run} ok", flush=True)
    ray.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
