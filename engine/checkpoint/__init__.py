"""A model's files: the registry of known models, config.json, where --model resolves to, the tokenizer,
the cache directory, the built-in tiny checkpoints and the completeness check."""
