"""`dsctl bench serving`: load benchmark for any OpenAI-compatible server (datasets, client, metrics, report)."""
