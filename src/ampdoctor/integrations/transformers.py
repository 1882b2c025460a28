"""A transformers ``TrainerCallback``: ampdoctor's pre-flight, guard, watch and crash explanation inside ``train()``.

>>> from ampdoctor.integrations.transformers import AmpDoctorCallback
>>> callback = AmpDoctorCallback(json_path="ampdoctor.json")
>>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[callback])  # doctest: +SKIP

What a callback gets (transformers 5.x, ``Trainer._inner_training_loop``): ``on_train_begin`` runs after
``accelerator.prepare``, so the forward is already wrapped in accelerate's autocast and the GradScaler exists; its
kwargs hold ``model`` (``trainer.model``, not the DDP wrapper) and ``optimizer`` (accelerate's
``AcceleratedOptimizer``, whose ``.scaler`` is the accelerator's). There is no Trainer reference and no exception
event, so the Trainer is read from the caller's frame (``CallbackHandler.call_event`` is called by the Trainer's own
methods) and, when found, a pass-through observer is set on the instance for the run: ``_run_epoch`` (to explain an
exception raised anywhere in an epoch; without it, ``training_step`` only). It is removed at the end.

What the Trainer's arguments add is read by the rules themselves, from the Trainer that holds the Accelerator, so
``ampdoctor run`` reports it too: ``fp16=True``/``bf16=True`` on a model loaded in half precision (AMP209, pre-flight),
NaN/inf losses the logged loss hides (AMP610, the watch checks every loss when ``logging_nan_inf_filter`` is on).
The callback names the clipping by the Trainer's argument: ``max_grad_norm`` on every step, with the pre-clip
gradient norm (AMP611).
"""

from __future__ import annotations

import sys
from typing import Any

from transformers import TrainerCallback

from ampdoctor._compat.accelerate import accelerator_autocast
from ampdoctor._compat.transformers import calling_trainer, epoch_method
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.options import RunOptions
from ampdoctor.core.report import Report
from ampdoctor.integrations._observe import on_exception as _on_exception
from ampdoctor.integrations._session import CallbackSession

__all__ = ["AmpDoctorCallback"]


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
        self.options = RunOptions(fix=fix, every=every, log_dir=log_dir, json_path=json_path, activations=activations,
                                  fix_command="AmpDoctorCallback(fix=True)")
        self.options.check_outputs()   # when the callback is built, not at the end of a long run
        self.session: CallbackSession | None = None
        self._handles: list[Any] = []

    @property
    def report(self) -> Report | None:
        """The report of the last ``train()`` (complete once it ended), or None before one started."""
        return None if self.session is None else self.session.report

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        main = bool(getattr(state, "is_world_process_zero", True))
        trainer = calling_trainer()   # the Trainer is the `self` of a calling frame: no callback is handed one
        # Every rank diagnoses its replica; in a job of several processes the session hands its report to rank 0.
        self.session = session = CallbackSession(self.options, show=main, main=main)
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
        session.start(model, [optimizer], scaler, autocast, accelerator=accelerator)
        if trainer is not None and session.started:   # the Trainer calls no callback after an exception
            self._handles.append(_on_exception(trainer, epoch_method(trainer), self._crashed))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._finish()

    def _crashed(self, exc: BaseException) -> None:
        if self.session is not None and not self.session.finished and isinstance(exc, Exception):
            self.session.explain(exc)
            self._finish()

    def _finish(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []
        session = self.session
        if session is None or session.finished:
            return
        if not session.started:   # train() without a model or an optimizer handed to the callbacks
            session.report.observed = {"models": 0, "optimizers": 0, "scalers": 0}
            session.started = True
        session.finish()

