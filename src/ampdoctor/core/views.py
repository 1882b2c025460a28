"""The one seam between data and the UI: a data object that rich can print is drawn by ``ampdoctor.ui``.

Data never imports the UI (the layers in ``pyproject.toml``; ``lint-imports`` checks them). Yet ``rich.print(report)``
and ``rich.print(watch.summary())`` are public API: such an object asks ``ampdoctor.ui.views.draw`` for its
renderable when rich draws it, looked up by name at that moment. This is the only place that does so; it adds no
import edge, so no layer depends on the UI, and the UI stays free to change how anything looks.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Drawn"]

_DRAWING = "ampdoctor.ui.views"


class Drawn:
    """A data object that rich draws through ``ampdoctor.ui.views.draw`` (see the module's description)."""

    def __rich__(self) -> Any:
        return importlib.import_module(_DRAWING).draw(self)
