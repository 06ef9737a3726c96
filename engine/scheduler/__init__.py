"""Requests and the scheduler: continuous batching with a radix prefix cache, chunked prefill and
overlap scheduling (scheduler.py; KV bookkeeping per request is engine/memory/request_memory.py),
the admission check's reservation for tokens still to come (admission.py), queue order (policy.py),
the one prompt check (prompt_check.py), and the output path: resolved samples -> request state and
per-request deltas (processor.py, with stops.py and detokenizer.py for stop strings; the delta and
its reassembly in output.py). Sampling (engine/sampling.py) leaves its results on the device for the
overlap loop."""
