"""The GradScaler guard: observes scale/unscale_/step/update and the calls around them."""
