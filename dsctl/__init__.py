"""dsctl: the operator's CLI for DeepSeek-V2/V3/R1 inference (download, tune, bench, serve)."""

__version__ = "0.1.0"
