"""KV memory: the paged latent KV pool, the request->token table, the radix prefix cache, and RequestMemory
(the one place slots move between them and requests)."""
