"""Callbacks for training frameworks: the same diagnosis as ``ampdoctor run``, from inside the framework's loop.

Each framework is its own module, imported only when asked for (the frameworks are optional extras):

* ``ampdoctor.integrations.lightning.AmpDoctorCallback``: a Lightning ``Callback``
  (the ``lightning`` extra: ``pip install -e ".[lightning]"`` in a clone);
* ``ampdoctor.integrations.transformers.AmpDoctorCallback``: a transformers ``TrainerCallback``
  (the ``hf`` extra).

Both take ``json_path``, ``log_dir``, ``every``, ``activations`` and ``fix``; see ``ampdoctor.integrations._session``
for what they share: pre-flight before the first step, the GradScaler guard and the numerics watch during training,
the crash explanation on an exception, and the final report.
"""

from __future__ import annotations

__all__: list[str] = []
