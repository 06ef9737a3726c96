"""KV memory: the paged latent KV pool and the request->token table."""
