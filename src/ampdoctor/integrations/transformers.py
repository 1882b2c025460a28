"""A transformers ``TrainerCallback``: ampdoctor's pre-flight, guard, watch and crash explanation inside ``train()``.

>>> from ampdoctor.integrations.transformers import AmpDoctorCallback
>>> callback = AmpDoctorCallback(json_path="ampdoctor.json")
>>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[callback])  # doctest: +SKIP

What a callback gets (transformers 5.x, ``Trainer._inner_training_loop``): ``on_train_begin`` runs after
``accelerator.prepare``, so the forward is already wrapped in accelerate's autocast and the GradScaler exists; its
kwargs hold ``model`` (``trainer.model``, not the DDP wrapper) and ``optimizer`` (accelerate's
``AcceleratedOptimizer``, whose ``.scaler`` is the accelerator's). There is no Trainer reference and no exception
event, so the Trainer is read from the caller's frame (``CallbackHandler.call_event`` is called by the Trainer's own
methods) and, when found, two pass-through observers are set on the instance for the run: ``training_step``
(to see each micro-batch loss, which ``logging_nan_inf_filter`` keeps out of the logs) and ``_run_epoch`` (to
explain an exception raised anywhere in an epoch; without it, ``training_step`` only). Both are removed at the end.

On top of the rules, it flags what only the Trainer's arguments show: ``fp16=True``/``bf16=True`` on a model loaded
in half precision (AMP209), NaN/inf losses the logged loss hides (AMP610), and ``max_grad_norm`` clipping, with the
pre-clip gradient norm (AMP611).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import TrainerCallback

from ampdoctor._compat.accelerate import accelerator_autocast
from ampdoctor._compat.transformers import calling_trainer, epoch_method
from ampdoctor.core.catalog import get_rule
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.findings import Finding
from ampdoctor.core.host_reads import to_host
from ampdoctor.core.patch import observe
from ampdoctor.core.report import Report
from ampdoctor.core.training import TrainingSetup, keeps_fp32_masters
from ampdoctor.integrations._observe import on_exception as _on_exception
from ampdoctor.integrations._session import CallbackSession, check_options

__all__ = ["AmpDoctorCallback", "half_model_findings"]

_HALF = (torch.float16, torch.bfloat16)
_NAMES = 5


class AmpDoctorCallback(TrainerCallback):
    """Diagnose mixed-precision problems of a transformers ``Trainer.train()``: a ``TrainerCallback``.

    Args:
        json_path: write the report there before the first step, after a crash and at the end.
        log_dir: the watch's JSON-lines flight recorder (``ampdoctor report LOG`` reads it).
        every: the watch samples the first 10 steps, then every ``every``-th.
        activations: also watch activations (first non-finite module, fp16 headroom).
        fix: before the first step, upcast trainable half parameters (the forward runs under accelerate's autocast
            with ``fp16``/``bf16``) or add fp32 master weights (no autocast), as ``ampdoctor run --fix``.

    Names are the model's (``classifier.weight``); the report is printed to stderr on the main process. Under
    torchrun every rank diagnoses its replica and records to its own ``ampdoctor.rank{r}.jsonl``; rank 0 prints and
    writes one report whose findings list the ranks that saw them.
    """

    def __init__(self, json_path: Any = None, log_dir: Any = None, every: int = 50, activations: bool = False,
                 fix: bool = False) -> None:
        check_options(json_path, log_dir, every)
        self.json_path, self.log_dir, self.every = json_path, log_dir, every
        self.activations, self.fix = activations, fix
        self.session: CallbackSession | None = None
        self._losses: _Losses | None = None
        self._handles: list[Any] = []
        self._args: Any = None

    @property
    def report(self) -> Report | None:
        """The report of the last ``train()`` (complete once it ended), or None before one started."""
        return None if self.session is None else self.session.report

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        main = bool(getattr(state, "is_world_process_zero", True))
        self._args = args
        trainer = calling_trainer()   # the Trainer is the `self` of a calling frame: no callback is handed one
        # Every rank diagnoses its replica; in a job of several processes the session hands its report to rank 0.
        self.session = session = CallbackSession(
            json_path=self.json_path, log_dir=self.log_dir, every=self.every, activations=self.activations,
            fix=self.fix, show=main, main=main)
        if model is None or optimizer is None:
            return   # nothing to diagnose; on_train_end reports that nothing was seen
        accelerator = getattr(trainer, "accelerator", None)
        scaler = getattr(optimizer, "scaler", None)
        if scaler is None:
            scaler = getattr(accelerator, "scaler", None)
        autocast = accelerator_autocast(accelerator)
        session.report.extra["framework"] = {
            "name": "transformers", "version": getattr(sys.modules.get("transformers"), "__version__", None),
            "fp16": bool(getattr(args, "fp16", False)), "bf16": bool(getattr(args, "bf16", False)),
            "mixed_precision": str(getattr(accelerator, "mixed_precision", None)),
            "autocast": None if autocast is None else dtype_name(autocast),
            "scaler": None if scaler is None else type(scaler).__name__,
            "max_grad_norm": getattr(args, "max_grad_norm", None),
            "logging_nan_inf_filter": getattr(args, "logging_nan_inf_filter", None),
        }
        session.clip_label = f"TrainingArguments(max_grad_norm={getattr(args, 'max_grad_norm', '?')})"
        session.start(model, [optimizer], scaler, autocast, accelerator=accelerator,
                      findings=lambda setup: half_model_findings(args, setup))
        if trainer is not None and session.started:
            self._losses = _Losses(state)
            self._observe(trainer, session)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._losses is not None:
            self._losses.step = int(getattr(state, "global_step", self._losses.step))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._finish(args)

    # ---- observers on the Trainer instance ----------------------------------------------------------------------
    def _observe(self, trainer: Any, session: CallbackSession) -> None:
        losses = self._losses
        if callable(getattr(trainer, "training_step", None)):
            self._handles.append(observe(trainer, "training_step", after=lambda loss, *a, **k: losses.record(loss),
                                         on_error=session.internal_error))
        self._handles.append(_on_exception(trainer, epoch_method(trainer), self._crashed))

    def _crashed(self, exc: BaseException) -> None:
        if self.session is not None and not self.session.finished and isinstance(exc, Exception):
            self.session.explain(exc)
            self._finish(self._args)   # the Trainer calls no callback after an exception

    def _finish(self, args: Any) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []
        session, losses = self.session, self._losses
        self._losses = None
        if session is None or session.finished:
            return
        if not session.started:   # train() without a model or an optimizer handed to the callbacks
            session.report.observed = {"models": 0, "optimizers": 0, "scalers": 0}
            session.started = True
        nan_filter = args is not None and bool(getattr(args, "logging_nan_inf_filter", False))
        session.finish(findings=lambda: losses.findings(session.report) if losses is not None and nan_filter else [])


def half_model_findings(args: Any, setup: TrainingSetup) -> list[Finding]:
    """Flag ``fp16=True``/``bf16=True`` on a model whose trainable parameters are half (AMP209).

    The flags ask accelerate for fp32 weights under fp16/bf16 autocast; a model loaded with ``dtype=torch.float16``
    (or cast with ``.half()``) has half weights instead, updated in half precision by a plain optimizer.
    """
    flag = "fp16" if getattr(args, "fp16", False) else "bf16" if getattr(args, "bf16", False) else None
    if flag is None or getattr(args, "deepspeed", None) or any(keeps_fp32_masters(o) for o in setup.optimizers):
        return []   # DeepSpeed and MasterWeights keep fp32 master weights of half parameters
    trainable = setup.trainable()
    half = [p for p in trainable if p.dtype in _HALF]
    if not half:
        return []
    dtypes = " and ".join(sorted({dtype_name(p.dtype) for p in half}))
    names = ", ".join(p.describe() for p in half[:_NAMES]) + (f" and {len(half) - _NAMES} more"
                                                               if len(half) > _NAMES else "")
    whole = "all" if len(half) == len(trainable) else f"{len(half)} of"
    consequence = ("a GradScaler refuses their float16 gradients ('Attempting to unscale FP16 gradients')"
                   if setup.scaler_enabled and any(p.dtype == torch.float16 for p in half) else
                   "the optimizer updates them in half precision, where small updates round away")
    return [get_rule("AMP209").finding(f"TrainingArguments({flag}=True)", (
        f"{flag}=True means fp32 weights with {flag} autocast, but {whole} {len(trainable)} trainable parameters are "
        f"{dtypes}: {names}. The model was loaded or cast in half precision (from_pretrained(..., "
        f"dtype=torch.{dtypes.split()[0]}) or .half()), so {consequence}."))]


class _Losses:
    """Count the non-finite micro-batch losses ``training_step`` returns, on the device (read once at the end)."""

    def __init__(self, state: Any) -> None:
        self.step = int(getattr(state, "global_step", 0))
        self.seen = 0
        self._bad: torch.Tensor | None = None     # [non-finite losses, first step with one (-1: none)]

    def record(self, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor):
            return
        with torch.no_grad():
            bad = (~torch.isfinite(loss.detach())).any().to(torch.float64)
            if self._bad is None or self._bad.device != bad.device:
                self._bad = torch.stack([bad, torch.where(bad > 0, float(self.step), -1.0)])
            else:
                first = torch.where((self._bad[1] < 0) & (bad > 0), float(self.step), self._bad[1])
                self._bad = torch.stack([self._bad[0] + bad, first])
        self.seen += 1

    def findings(self, report: Report) -> list[Finding]:
        if self._bad is None:
            return []
        bad, first = to_host(self._bad, "transformers")   # the one read, at the end of the run
        if not bad:
            return []
        scale = (report.extra.get("watch") or {}).get("scale") or {}
        skipped = scale.get("skipped") if isinstance(scale, dict) else None
        also = f"; the GradScaler skipped {skipped} step(s)" if isinstance(skipped, int) and skipped else ""
        return [get_rule("AMP610").finding("TrainingArguments(logging_nan_inf_filter=True)", (
            f"{int(bad)} of {self.seen} training losses were NaN/inf, the first at step {int(first)}{also}. With "
            "logging_nan_inf_filter=True (the default) the Trainer adds the average of the earlier losses in their "
            "place, so the logged loss looks finite; set logging_nan_inf_filter=False to see them."), int(first))]
