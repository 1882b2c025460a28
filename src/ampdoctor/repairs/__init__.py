"""Fix: in-place repairs (upcast trainable parameters, fp32 master weights)."""
