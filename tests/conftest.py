"""Shared test setup: keep built-in checkpoints in a per-session cache dir, quiet transformers."""

import os
import tempfile

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DSCTL_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dsctl-test-cache"))
