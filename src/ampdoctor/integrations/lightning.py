"""A Lightning callback: ampdoctor's pre-flight, guard, watch and crash explanation inside ``Trainer.fit``.

>>> from ampdoctor.integrations.lightning import AmpDoctorCallback
>>> callback = AmpDoctorCallback(json_path="ampdoctor.json")
>>> trainer = lightning.Trainer(precision="bf16-mixed", callbacks=[callback])  # doctest: +SKIP

When the hooks fire (Lightning 2.x, ``lightning/pytorch/trainer/trainer.py``): ``on_fit_start`` runs after
``strategy.setup``, so the module is cast (``16-true``/``bf16-true`` convert the whole module), moved and wrapped,
and the optimizers and the precision plugin's GradScaler exist; the sanity check and the first step come after it.
``on_exception`` gets any exception out of ``fit``, then ``teardown`` runs and the exception is re-raised; except in
the workers of ``ddp_spawn`` (``ddp_fork``, ``ddp_notebook``), where the launcher runs the fit without that handling:
there an observer on the trainer's method that runs the fit (``ampdoctor._compat.lightning``) sees the exception.

Precision plugins, read from the trainer without constructing anything (``transformer-engine`` may not be
importable): ``16-mixed``/``bf16-mixed`` are ``MixedPrecision``, autocast in fp16/bf16, with a GradScaler for
``16-mixed`` (``trainer.precision_plugin.scaler``; Lightning makes none on CPU, where it turns ``16-mixed`` into
``bf16-mixed``); ``16-true``/``bf16-true`` are ``HalfPrecision``, the whole module cast, no autocast, no scaler;
``transformer-engine[-float16]`` casts the weights to its ``weights_dtype`` and runs TransformerEngine's own fp8
autocast, not ``torch.autocast``. ``lightning.pytorch`` and ``pytorch_lightning`` are separate packages; the callback
subclasses the ``Callback`` of both when ``pytorch_lightning`` is already imported.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import torch

from ampdoctor._compat.lightning import spawned_worker, stage_method
from ampdoctor.core.isolation import call_safely
from ampdoctor.core.options import RunOptions
from ampdoctor.core.report import Report
from ampdoctor.core.training import unwrap_optimizer
from ampdoctor.integrations._observe import on_exception
from ampdoctor.integrations._session import CallbackSession

__all__ = ["AmpDoctorCallback", "autocast_dtype_of", "precision_of"]

_AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "16": torch.float16, "bf16": torch.bfloat16}


def precision_of(trainer: Any) -> str:
    """Return the trainer's precision flag as its plugin states it (``"16-mixed"``, ``"transformer-engine"``, ...).

    Read from the plugin's ``precision`` attribute (a class attribute on ``HalfPrecision`` and
    ``TransformerEnginePrecision``), so nothing is constructed or imported.
    """
    plugin = getattr(trainer, "precision_plugin", None)
    return str(getattr(plugin, "precision", "32-true"))


def autocast_dtype_of(trainer: Any) -> torch.dtype | None:
    """Return the dtype of the ``torch.autocast`` the trainer runs ``training_step`` under, None for none.

    ``MixedPrecision`` (``16-mixed``, ``bf16-mixed``; also FSDP's and DeepSpeed's plugins with those flags) autocasts;
    ``HalfPrecision`` (``16-true``, ``bf16-true``) and TransformerEngine (its own fp8 autocast) do not.
    """
    return _AUTOCAST.get(precision_of(trainer))


class _Hooks:
    """The hooks; mixed into the ``Callback`` classes of ``lightning.pytorch`` (and ``pytorch_lightning``)."""

    def __init__(self, json_path: Any = None, log_dir: Any = None, every: int = 50, activations: bool = False,
                 fix: bool = False) -> None:
        self.options = RunOptions(fix=fix, every=every, log_dir=log_dir, json_path=json_path, activations=activations,
                                  fix_command="AmpDoctorCallback(fix=True)")
        self.options.check_outputs()   # when the callback is built, not at the end of a long run
        self.session: CallbackSession | None = None
        self._observer: Any = None

    @property
    def report(self) -> Report | None:
        """The report of the last ``fit`` (complete once it ended), or None before one started."""
        return None if self.session is None else self.session.report

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        main = bool(getattr(trainer, "is_global_zero", True))
        # Every rank diagnoses its replica; in a job of several processes the session hands its report to rank 0.
        wrapped = self.options.fix and _wrapped(trainer, pl_module)
        self.session = session = CallbackSession(self.options.replace(fix=self.options.fix and not wrapped),
                                                 show=main, main=main)
        if wrapped:
            session._event(f"ampdoctor --fix: the LightningModule is already wrapped in "
                           f"{type(trainer.strategy.model).__name__}, whose buffers keep the old dtypes; nothing "
                           "changed. Fix the dtypes in configure_model() or before Trainer.fit().")
        precision = precision_of(trainer)
        plugin = getattr(trainer, "precision_plugin", None)
        scaler = getattr(plugin, "scaler", None)
        package = type(trainer).__module__.split(".")[0]   # "lightning" or "pytorch_lightning"
        session.report.extra["framework"] = {
            "name": package, "version": getattr(sys.modules.get(package), "__version__", None),
            "precision": precision, "precision_plugin": type(plugin).__name__,
            "scaler": None if scaler is None else type(scaler).__name__,
        }
        gradient_clip = getattr(trainer, "gradient_clip_val", None)
        if gradient_clip:
            session.clip_label = f"Trainer(gradient_clip_val={gradient_clip})"
        optimizers = [unwrap_optimizer(o) for o in getattr(trainer, "optimizers", [])]
        session.start(pl_module, optimizers, scaler, autocast_dtype_of(trainer))
        stage = stage_method(trainer) if session.started and spawned_worker(trainer) else None
        if stage is not None:   # no on_exception in this worker: watch the training itself
            self._observer = call_safely(on_exception, trainer, stage,
                                         lambda exc: self.on_exception(trainer, pl_module, exc),
                                         on_error=session.internal_error)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._unobserve()
        if self.session is None or self.session.finished:
            return
        if isinstance(exception, Exception):   # not KeyboardInterrupt or SystemExit: nothing to explain
            self.session.explain(exception)
        self.session.finish()   # Lightning calls no teardown hook of a callback after an exception

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._unobserve()
        if self.session is not None:
            self.session.finish()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._unobserve()
        if self.session is not None and stage == "fit":
            self.session.finish()

    def _unobserve(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.remove()


def _wrapped(trainer: Any, pl_module: Any) -> bool:
    """Whether the strategy wrapped the module (DDP, FSDP): a dtype fix after wrapping would break its buffers."""
    model = getattr(getattr(trainer, "strategy", None), "model", None)
    return model is not None and model is not pl_module


def _bases() -> tuple[type, ...]:
    bases: list[type] = [_Hooks, pl.Callback]
    classic = sys.modules.get("pytorch_lightning")   # a separate package: its own Callback class
    if classic is not None and getattr(classic, "Callback", pl.Callback) is not pl.Callback:
        bases.append(classic.Callback)
    return tuple(bases)


class AmpDoctorCallback(*_bases()):  # type: ignore[misc]
    """Diagnose mixed-precision problems of a Lightning ``Trainer.fit``: a ``Callback``.

    Args:
        json_path: write the report there before the first step, after a crash and at the end.
        log_dir: the watch's JSON-lines flight recorder (``ampdoctor report LOG`` reads it).
        every: the watch samples the first 10 steps, then every ``every``-th.
        activations: also watch activations (first non-finite module, fp16 headroom).
        fix: before the first step, upcast trainable half parameters (under ``16-mixed``/``bf16-mixed``) or add
            fp32 master weights (``16-true``/``bf16-true``), as ``ampdoctor run --fix``.

    Names are the LightningModule's (``head.weight``); the report is printed to stderr on the main process. With
    ``strategy="ddp"``/``"ddp_spawn"`` every rank diagnoses its replica and records to its own
    ``ampdoctor.rank{r}.jsonl``; rank 0 prints and writes one report whose findings list the ranks that saw them.
    """
