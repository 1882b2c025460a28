"""Watch: gradient statistics, loss scale and skipped steps, lost updates, activations, op replay, flight recorder."""
