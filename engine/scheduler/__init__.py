"""Requests and the scheduler: continuous batching with a radix prefix cache, chunked prefill and
overlap scheduling (scheduler.py), KV bookkeeping per request (memory.py), queue order (policy.py).
Sampling (engine/sampling.py) leaves its results on the device for the overlap loop."""
