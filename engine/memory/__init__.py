"""KV memory: the paged latent KV pool, the request->token table, the radix prefix cache, and RequestMemory
(the one place slots move between them and requests); the memory plan of one rank before start-up (plan.py,
plan_check.py, formats.py, weight_tally.py, fit.py)."""
