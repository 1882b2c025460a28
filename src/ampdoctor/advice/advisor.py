"""``advise``: memory per strategy, what the device supports, what a flight recorder says, and one recommendation."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from ampdoctor.advice.activations import ActivationBytes, InputMaker, measure_activations, repeated_blocks
from ampdoctor.advice.device import device_support
from ampdoctor.advice.lora import lora_parameter_count, lora_targets
from ampdoctor.advice.recipes import recipe
from ampdoctor.advice.sources import load_model, unique_parameters
from ampdoctor.advice.states import OPTIMIZERS, STRATEGIES, ParamInfo, model_state_bytes, sharded_keys
from ampdoctor.core.strict_json import json_text
from ampdoctor.core.views import Drawn

__all__ = ["advise", "Advice", "parse_size", "PREFERENCE"]

COMPONENTS = ("weights", "gradients", "optimizer_state", "master_weights", "activations")
# Cheapest first: least slowdown and least change to what is trained. fp32 is the baseline, never the advice.
PREFERENCE = ("amp_bf16", "amp_fp16", "amp_bf16_adamw8bit", "amp_bf16_checkpoint", "fp16_master", "zero1", "zero2",
              "fsdp", "zero3", "pure_bf16", "lora")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Return bytes for ``"24GiB"``, ``"80GB"``, ``"1.5 TiB"`` or a plain number of bytes.

    >>> parse_size("24GiB"), parse_size("80GB"), parse_size(1024)
    (25769803776, 80000000000, 1024)
    """
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read the size {text!r}; write it like 24GiB, 80GB or 16000000000")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass
class Advice(Drawn):
    """What ``advise`` found; ``to_dict()`` is the JSON, ``rich.print(advice)`` the table."""

    model: str
    parameters: int
    trainable: int
    batch_size: int
    seq_len: int
    budget: int | None
    devices: int
    optimizer: str
    lora: dict[str, Any]
    strategies: list[dict[str, Any]]
    device: dict[str, Any]
    evidence: dict[str, Any] | None = None
    recommendation: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def strategy(self, key: str) -> dict[str, Any]:
        """Return the entry of strategy ``key``."""
        for entry in self.strategies:
            if entry["key"] == key:
                return entry
        raise KeyError(f"no strategy {key!r}; have {[e['key'] for e in self.strategies]}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """Return the advice as strict JSON (``core.strict_json.json_text``: an inf or NaN of a log as a string)."""
        return json_text(self.to_dict(), indent=2)


def advise(model: nn.Module | str, *, batch_size: int = 1, seq_len: int = 512, budget: str | int | None = None,
           devices: int = 1, lora_rank: int = 8, optimizer: str = "adamw", log: str | None = None,
           activations: bool = True, inputs: InputMaker | None = None, device: str | None = None) -> Advice:
    """Estimate memory per training strategy and recommend the cheapest one that fits and is numerically safe.

    Args:
        model: an ``nn.Module`` (not changed), ``"package.module:factory"``, or a transformers config folder or
            ``config.json`` (built on the meta device: a 70B config costs no memory).
        batch_size, seq_len: the micro-batch per device; ``seq_len`` is the spatial side for convolutions.
        budget: memory per device (``"24GiB"``, ``"80GB"`` or bytes); None: report without a fit test.
        devices: data-parallel devices for the ZeRO/FSDP rows (shown when more than one).
        lora_rank: the rank of the LoRA row.
        optimizer: ``"adamw"``, ``"adamw8bit"`` (bitsandbytes) or ``"sgd"`` (momentum 0.9).
        log: a flight recorder (``ampdoctor.jsonl``) whose gradients say whether fp16/bf16 are safe.
        activations: measure activations with fake runs (a few seconds for a 7B model); False: model states only.
        inputs: ``f(model, batch_size, seq_len, dtype) -> (args, kwargs)`` when the default inputs do not fit.
        device: where training will run, ``"cuda"`` (``"cuda:N"``) or ``"cpu"``: what it supports, and the device
            type in the recommended code; None: CUDA when torch sees a device, else the CPU.

    >>> import torch
    >>> a = advise(torch.nn.Linear(1024, 1024), batch_size=4, seq_len=8, budget="1GiB")
    >>> a.parameters, a.strategy("amp_bf16")["bytes"]["weights"], a.recommendation["strategy"]
    (1049600, 4198400, 'amp_bf16')
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("devices", devices),
                        ("lora_rank", lora_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    budget_bytes = None if budget is None else parse_size(budget)
    support = device_support(device)   # before the model is built: a device that is not here is a usage error
    source = load_model(model)
    params = unique_parameters(source.model)
    targets, rule = lora_targets(source.model, source.model_type)
    blocks = repeated_blocks(source.model)
    info = ParamInfo(trainable=[p.numel() for _, p in params if p.requires_grad],
                     frozen=[p.numel() for _, p in params if not p.requires_grad],
                     adapters=[n for _, i, o in targets for n in (lora_rank * i, o * lora_rank)],
                     largest_block=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0))
    chosen = [s for s in STRATEGIES if (devices > 1 or s.key not in sharded_keys())
              and not (s.key == "amp_bf16_adamw8bit" and optimizer != "adamw")]
    runs: dict[str, ActivationBytes] = {}
    if activations:
        lora = (targets, lora_rank)
        for run in dict.fromkeys(s.run for s in chosen):
            runs[run] = measure_activations(source, run, batch_size, seq_len, lora=lora, inputs=inputs)
    rows = [_row(s, info, optimizer, devices, runs.get(s.run), budget_bytes) for s in chosen]
    evidence = None
    if log is not None:
        from ampdoctor.advice.evidence import read_evidence

        evidence = read_evidence(log)
    advice = Advice(model=source.name, parameters=info.total, trainable=sum(info.trainable), batch_size=batch_size,
                    seq_len=seq_len, budget=budget_bytes, devices=devices, optimizer=optimizer,
                    lora={"rank": lora_rank, "targets": len(targets), "parameters":
                          lora_parameter_count(targets, lora_rank), "rule": rule},
                    strategies=rows, device=support, evidence=evidence)
    advice.recommendation = _recommend(advice)
    if not activations:
        advice.notes.append("activations not measured (activations=False): totals are model states only")
    return advice


def _row(strategy: Any, info: ParamInfo, optimizer: str, devices: int, measured: ActivationBytes | None,
         budget: int | None) -> dict[str, Any]:
    states = model_state_bytes(strategy.key, info, optimizer, devices)
    act = measured.activations if measured is not None else None
    total = sum(states.values()) + (act or 0)
    entry: dict[str, Any] = {
        "key": strategy.key, "title": strategy.title, "compute": strategy.compute, "note": strategy.note,
        "bytes": {**states, "activations": act, "total": total},
        "activation_detail": None if measured is None else {
            "run": measured.run, "weight_copies": measured.weight_copies,
            "peak_with_gradients": measured.with_gradients, "error": measured.error},
        "fits": None if budget is None else total <= budget,
    }
    return entry


def _safety(advice: Advice, key: str, compute: str) -> tuple[bool, str]:
    """Return whether strategy ``key`` is numerically safe here, and why (or why not)."""
    safe = (advice.evidence or {}).get("safe", {})
    if key == "pure_bf16":
        if safe.get("pure_bf16"):
            return True, "the log shows at most 1% of updates lost in bf16 parameters"
        return False, ("pure bf16 loses updates below half an ulp of the weight; without a log showing it does not, "
                       "use fp32 master weights, Kahan summation or stochastic rounding")
    if compute == "bf16":
        if not advice.device.get("bf16"):
            return False, f"{advice.device.get('name')} has no bf16"
        if safe.get("bf16") is False:
            return False, "the log shows gradients that underflow in bf16"
        return True, "bf16 keeps fp32's exponent range" + (" (the log agrees)" if safe.get("bf16") else "")
    if compute == "fp16":
        if safe.get("fp16") is False:
            return False, "the log shows no single loss scale keeps the smallest and largest gradients in fp16"
        return True, ("a GradScaler finds a loss scale that fits the logged gradients" if safe.get("fp16") else
                      "with a GradScaler (no log to check the gradients against)")
    return True, "fp32"


def _recommend(advice: Advice) -> dict[str, Any] | None:
    """Pick the first strategy of ``PREFERENCE`` that fits the budget and is safe; prefer the device's format."""
    order = list(PREFERENCE)
    if advice.device.get("prefer") == "fp16":
        order.remove("amp_fp16")
        order.insert(0, "amp_fp16")
    rows = {r["key"]: r for r in advice.strategies}
    skipped = []
    for key in order:
        row = rows.get(key)
        if row is None:
            continue
        ok, why = _safety(advice, key, row["compute"])
        if not ok:
            skipped.append(f"{key}: {why}")
            continue
        if row["fits"] is False:
            skipped.append(f"{key}: needs {row['bytes']['total'] / 2**30:.2f} GiB")
            continue
        return {"strategy": key, "title": row["title"], "why": why, "total": row["bytes"]["total"],
                "recipes": recipe(key, advice.lora["rank"], advice.device["device"]), "skipped": skipped}
    return {"strategy": None, "why": "nothing fits: raise --devices, lower --batch-size or --seq-len, or combine "
            "strategies (LoRA + checkpointing)", "skipped": skipped, "recipes": {}}
