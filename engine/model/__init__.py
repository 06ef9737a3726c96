"""The DeepSeek model in plain torch modules, with pluggable attention/MoE backends."""
