"""The built-in parts of a watch, one file each (``monitor.part``): imported here, each registers itself."""

from ampdoctor.monitor.parts import activations, averages, gradients, loss, scale, updates  # noqa: F401
