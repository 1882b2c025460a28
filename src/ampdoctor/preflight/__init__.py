"""Predict: pre-flight rules over the real model, optimizer and GradScaler, run by `check()`."""
