"""The findings of ``scaler.step()`` misuse that the guard proves from its records (AMP404)."""

from __future__ import annotations

from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding
from ampdoctor.guard.history import _Call


def _second_step(first: _Call | None, label: str, site: str, scale_calls: int, index: int) -> Finding:
    """AMP404: say that no ``update()`` completed between two steps of one optimizer, and which fix applies.

    Args:
        first: the earlier ``step()`` of this optimizer in the iteration, if recorded.
        label: the optimizer's name, ``optimizer[0] (SGD)``.
        site: ``file:line`` of the second step.
        scale_calls: ``scale()`` calls so far in the iteration, to count the backward passes between the steps.
        index: the iteration.
    """
    detail = (f"scaler.step({label}) at {site} is the second step of {label}, and no scaler.update() completed "
              f"since the first, at {first.site if first else '<unknown>'}")
    between = scale_calls - first.scale_calls if first is not None else None
    if between:
        detail += (f"; {between} scaler.scale() call(s) ran between the two steps (one loss each): call "
                   "scaler.update() after every scaler.step(), or sum the losses and step once")
    elif between == 0:
        detail += ("; no scaler.scale() ran between them, so the second step reuses the same gradients: drop it, "
                   "or call scaler.update() after the first")
    else:
        detail += "; call scaler.update() after every scaler.step()"
    return get_rule("AMP404").finding(label, detail, index)
