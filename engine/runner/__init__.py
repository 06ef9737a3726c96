"""Running the model on one rank: ModelRunner (build, KV memory, forwards), CUDA graphs, Triton precompile."""
