"""The built-in parts of a watch, one file each (``monitor.part``): importing this package registers them."""

from ampdoctor.monitor.part import WatchPart, registered
from ampdoctor.monitor.parts import activations, averages, gradients, loss, numerics_audit, scale, state, updates  # noqa: F401,E501

__all__ = ["parts"]


def parts() -> list[type[WatchPart]]:
    """Return the parts a watch attached now creates, in the order it calls them: the built-in ones and every part
    registered since (``monitor.part.register_part``)."""
    return registered()
