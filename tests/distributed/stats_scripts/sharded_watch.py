"""Run ``ampdoctor.watch`` on a tiny model under real torch.distributed (gloo, CPU) and dump what it saw as JSON.

    python sharded_watch.py MODE WORLD OUT.json

MODE: ``fsdp2`` (fully_shard, bf16 MixedPrecisionPolicy, clip_grad_norm_ handed
to the watch as ``ampdoctor run`` does), ``fsdp1`` (FullyShardedDataParallel, FULL_SHARD),
``partial`` (a Partial DTensor gradient), ``ddp_overflow`` (DDP; rank 1's forward overflows fp16, activations on),
``fsdp1_orig`` (FSDP1 FULL_SHARD with ``use_orig_params=True``: the optimizer steps views into the flat parameter,
some split across the ranks, some with no entry on a rank), ``dp_tp`` (4 ranks: a ("dp", "tp") mesh, tensor
parallelism over tp and fully_shard over dp; a layer whose shards are empty on the dp=1 ranks),
``collective_forward`` (no wrapper; a module all-reduces in its forward, rank 1's forward overflows at step 1),
``inf_plain``, ``inf_sharded``, ``inf_none`` (FSDP1 FULL_SHARD with a plain GradScaler, a ShardedGradScaler or none:
at step 1 an inf is written into rank 0's own gradient shard, after backward, before the step).
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


def _tp_model(torch, nn):
    """Column/row-parallel pairs, a 2-output column-parallel layer (1 row per tp rank: empty on the dp=1 ranks
    once fully_shard splits it) and a plain layer that only fully_shard splits."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 20), nn.ReLU(), nn.Linear(20, 2),
                         nn.Linear(2, 3))


def _CrossRankCenter(torch, dist):
    """A module whose forward all-reduces (like SyncBatchNorm): it subtracts the mean over every rank's batch."""
    class CrossRankCenter(torch.nn.Module):
        def forward(self, x):
            mean = x.detach().float().mean().reshape(1)
            dist.all_reduce(mean)
            return x - (mean / dist.get_world_size()).to(x.dtype)
    return CrossRankCenter()


def _single(torch, nn, build, rank, steps):
    """The same model trained alone on the same batches: the single-process statistics of the last step."""
    from ampdoctor.monitor.grad_stats import GradStats
    from ampdoctor.monitor.gradients import rows_to_dicts

    model = build(torch, nn)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x, y = _batch(torch, rank, same=True)
        nn.functional.mse_loss(model(x).float(), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    names = [n for n, _ in model.named_parameters()]
    return rows_to_dicts(GradStats([g.numel() for g in grads]).compute(grads).tolist(), names)


def _batch(torch, rank, same):
    gen = torch.Generator().manual_seed(100 + (0 if same else rank))
    return torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)


def run(rank: int, mode: str, world: int, out: str, store: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import ampdoctor

    # a short collective timeout: a rank left waiting (the bug these runs test for) ends instead of lingering
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}",
                            timeout=datetime.timedelta(seconds=60))
    result: dict = {"rank": rank}
    try:
        if mode.startswith("inf_"):
            _inf_in_rank_0_shard(torch, nn, mode, rank, result)
            return
        model = _wrapped(torch, nn, dist, mode, _model(torch, nn), result)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu") if mode == "ddp_overflow" else None
        watch = ampdoctor.watch(model, opt, scaler, every=1, stats="full",
                                activations=mode in ("ddp_overflow", "collective_forward"))
        weight = model[4].weight if mode == "partial" else None
        full = None
        for step in range(3 if mode == "collective_forward" else 2):
            x, y = _batch(torch, rank, same=mode != "fsdp1")
            overflow = rank == 1 and step == 1   # fp16 overflows in rank 1's first Linear only
            if mode == "ddp_overflow":
                result.setdefault("steps", []).append(_scaled_step(torch, nn, model, opt, scaler, x, y, overflow))
            elif mode == "collective_forward":
                result.setdefault("losses", []).append(_collective_step(torch, nn, model, opt, x, y, overflow))
            else:
                full = _plain_step(torch, nn, mode, model, opt, watch, (x, y), world, weight, result)
        _add_references(torch, nn, dist, mode, model, watch, full, rank, world, result)
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


def _inf_in_rank_0_shard(torch, nn, mode, rank, result):
    """FSDP1 with a plain GradScaler, a ShardedGradScaler or none; at step 1 rank 0's own gradient shard holds an
    inf. Record each rank's findings, its loss scales and whether its step changed its shard."""
    import ampdoctor

    model = _wrapped(torch, nn, None, "fsdp1", _model(torch, nn), result)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kind = mode.removeprefix("inf_")
    if kind == "sharded":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        scaler = ShardedGradScaler("cpu")
    else:
        scaler = torch.amp.GradScaler("cpu") if kind == "plain" else None
    watch = ampdoctor.watch(model, opt, scaler, every=1)
    for step in range(2):
        x, y = _batch(torch, rank, same=False)
        loss = nn.functional.mse_loss(model(x).float(), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if step == 1 and rank == 0:
            model._handle.flat_param.grad.view(-1)[0] = float("inf")   # this rank's shard: entry 0 is rank 0's
        before = [p.detach().clone() for p in model.parameters()]
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
            result.setdefault("scales", []).append(scaler.get_scale())
        result.setdefault("stepped", []).append(not all(torch.equal(b, p.detach())
                                                        for b, p in zip(before, model.parameters())))
        opt.zero_grad()
    watch.detach()
    result["findings"] = [f.to_dict() for f in watch.findings()]


def _wrapped(torch, nn, dist, mode, model, result):
    """Return the model as MODE trains it: sharded, parallelized, in DDP, or rebuilt around a collective."""
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
    elif mode == "fsdp1_orig":
        from torch.distributed.fsdp import FullyShardedDataParallel
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
        result["local_numels"] = {n: p.numel() for n, p in model.named_parameters()}
    elif mode == "dp_tp":
        model = _dp_tp(torch, nn, result)
    elif mode == "ddp_overflow":
        model = nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.Linear(24, 3))
        model = nn.parallel.DistributedDataParallel(model)
    elif mode == "collective_forward":
        model = nn.Sequential(nn.Linear(12, 24), _CrossRankCenter(torch, dist), nn.Linear(24, 3))
    return model


def _dp_tp(torch, nn, result):
    """Return the tensor-parallel model on a ("dp", "tp") mesh of 4 ranks, fully sharded over dp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tp_model(torch, nn)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                           "4": ColwiseParallel(output_layouts=Replicate())})
    for layer in (model[0], model[2], model[4], model[5]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    result["placements"] = {n: [str(p) for p in q.placements] for n, q in model.named_parameters()}
    result["local_numels"] = {n: q.to_local().numel() for n, q in model.named_parameters()}
    return model


def _scaled_step(torch, nn, model, opt, scaler, x, y, overflow):
    """Train one fp16 autocast step with the GradScaler; return what the scaler decided and whether it updated."""
    if overflow:
        x = x * 1e6
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
    return {"found_inf": found, "scale": scale_before, "params_unchanged": unchanged}


def _collective_step(torch, nn, model, opt, x, y, overflow):
    """Train one fp16 autocast step with no scaler; return its loss."""
    if overflow:
        x = x * 1e6
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _plain_step(torch, nn, mode, model, opt, watch, batch, world, weight, result):
    """Train one fp32 step; return the whole gradients of this step, before the optimizer steps."""
    x, y = batch
    loss = nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    if mode == "fsdp2":  # of DTensor grads, clip_grad_norm_ returns a DTensor norm; 1e9: no clipping
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        watch.note_clip(norm)   # as `ampdoctor run` and the integrations hand it over
        result["clip_norm"] = [type(norm).__name__, [str(p) for p in norm.placements]]
    if mode == "partial":  # a pending sum over the ranks, as tensor parallelism leaves some grads
        from torch.distributed.tensor import DTensor, Partial
        local = weight.grad.full_tensor() / world
        weight.grad = DTensor.from_local(local, weight.device_mesh, [Partial()], run_check=False)
    grads = [p.grad for p in model.parameters()]
    full = [g.full_tensor() if hasattr(g, "full_tensor") and mode != "partial" else g for g in grads]
    if mode == "fsdp1_orig":  # the whole gradient of every original parameter, gathered by FSDP
        from torch.distributed.fsdp import FullyShardedDataParallel
        with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
            full = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    return full


def _add_references(torch, nn, dist, mode, model, watch, full, rank, world, result):
    """Record what the watch's statistics are compared with: those of the whole last gradients, and of the same
    model trained alone."""
    from ampdoctor.monitor.grad_stats import GradStats
    from ampdoctor.monitor.gradients import rows_to_dicts

    if mode == "fsdp1":  # reference: the flat parameter's whole gradient, gathered
        flat = full[0]
        pad = getattr(model._handle.flat_param, "_shard_numel_padded", 0)
        gathered = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        full = [torch.cat(gathered)[:sum(p.numel() for p in _model(torch, nn).parameters())]]
        result["pad"] = pad
    if mode in ("fsdp2", "fsdp1", "fsdp1_orig", "dp_tp"):
        ref = GradStats([g.numel() for g in full]).compute(full).tolist()
        result["reference"] = rows_to_dicts(ref, watch.param_names)
    if mode in ("fsdp1_orig", "dp_tp"):
        result["single"] = _single(torch, nn, _model if mode == "fsdp1_orig" else _tp_model, rank, steps=2)


def main(argv: list[str]) -> None:
    import torch.multiprocessing as mp

    mode, world, out = argv[0], int(argv[1]), argv[2]
    store = os.path.join(tempfile.mkdtemp(), "store")
    mp.spawn(run, args=(mode, world, out, store), nprocs=world, join=True)


if __name__ == "__main__":
    main(sys.argv[1:])
