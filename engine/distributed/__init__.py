"""Process model for tensor parallelism: flags, process groups, collectives, rank launch, memory sizing.

One engine process per GPU rank, joined with torch.distributed (NCCL on CUDA, gloo on
CPU). Import the submodules directly; this package imports nothing heavy on its own
(`launch` and `parallel_config` do not import torch, so rank supervisors stay light).
"""
