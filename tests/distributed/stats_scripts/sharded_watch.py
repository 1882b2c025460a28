"""Run ``ampdoctor.watch`` on a tiny model under real torch.distributed (gloo, CPU) and dump what it saw as JSON.

    python sharded_watch.py MODE WORLD OUT.json

MODE: ``fsdp2`` (fully_shard, bf16 MixedPrecisionPolicy), ``fsdp1`` (FullyShardedDataParallel, FULL_SHARD),
``partial`` (a Partial DTensor gradient), ``ddp_overflow`` (DDP; rank 1's forward overflows fp16, activations on).
Every rank writes ``OUT.<rank>.json``. Nothing runs on import (pytest imports modules for doctests).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import warnings


def _rows(watch):
    return {name: {k: v for k, v in stats.items()} for name, stats in watch.last_grads.items()}


def _model(torch, nn):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 20), nn.ReLU(), nn.Linear(20, 3))


def _batch(torch, rank, same):
    gen = torch.Generator().manual_seed(100 + (0 if same else rank))
    return torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)


def run(rank: int, mode: str, world: int, out: str, store: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import ampdoctor
    from ampdoctor.monitor.grad_stats import GradStats
    from ampdoctor.monitor.gradients import rows_to_dicts

    # a short collective timeout: a rank left waiting (the bug these runs test for) ends instead of lingering
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}",
                            timeout=datetime.timedelta(seconds=60))
    result: dict = {"rank": rank}
    try:
        model = _model(torch, nn)
        if mode in ("fsdp2", "partial"):
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
            for layer in (model[0], model[2], model[4]):
                fully_shard(layer, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        elif mode == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
        elif mode == "ddp_overflow":
            model = nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.Linear(24, 3))
            model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu") if mode == "ddp_overflow" else None
        watch = ampdoctor.watch(model, opt, scaler, every=1, stats="full", activations=mode == "ddp_overflow")
        if mode == "partial":
            from torch.distributed.tensor import DTensor, Partial
            weight = model[4].weight
        for step in range(2):
            x, y = _batch(torch, rank, same=mode != "fsdp1")
            if mode == "ddp_overflow":
                if rank == 1 and step == 1:
                    x = x * 1e6  # fp16 overflows in rank 1's first Linear only
                before = [p.detach().clone() for p in model.parameters()]
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                found = sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
                scale_before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                unchanged = all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
                result.setdefault("steps", []).append({"found_inf": found, "scale": scale_before,
                                                       "params_unchanged": unchanged})
            else:
                loss = nn.functional.mse_loss(model(x).float(), y)
                loss.backward()
                if mode == "partial":  # a pending sum over the ranks, as tensor parallelism leaves some grads
                    local = weight.grad.full_tensor() / world
                    weight.grad = DTensor.from_local(local, weight.device_mesh, [Partial()], run_check=False)
                grads = [p.grad for p in model.parameters()]
                full = [g.full_tensor() if hasattr(g, "full_tensor") and mode != "partial" else g for g in grads]
                opt.step()
                opt.zero_grad()
        if mode == "fsdp1":  # reference: the flat parameter's whole gradient, gathered
            flat = full[0]
            pad = getattr(model._handle.flat_param, "_shard_numel_padded", 0)
            gathered = [torch.zeros_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            full = [torch.cat(gathered)[:sum(p.numel() for p in _model(torch, nn).parameters())]]
            result["pad"] = pad
        if mode in ("fsdp2", "fsdp1"):
            ref = GradStats([g.numel() for g in full]).compute(full).tolist()
            result["reference"] = rows_to_dicts(ref, watch.param_names)
        watch.detach()
        summary = watch.summary_data()
        result.update(stats=_rows(watch), gradients=summary["gradients"],
                      findings=[f.to_dict() for f in watch.findings()], host_syncs=watch.host_syncs,
                      activations=summary["activations"])
    finally:
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump(result, f, default=str)
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    import torch.multiprocessing as mp

    mode, world, out = argv[0], int(argv[1]), argv[2]
    store = os.path.join(tempfile.mkdtemp(), "store")
    mp.spawn(run, args=(mode, world, out, store), nprocs=world, join=True)


if __name__ == "__main__":
    main(sys.argv[1:])
