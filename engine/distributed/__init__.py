"""Tensor parallelism and DP attention: flags, process groups, collectives, DP-attention gathers and
agreement, a decode step's bytes floor (memory per rank is engine/memory/plan.py's).

One engine process per GPU rank, joined with torch.distributed (NCCL on CUDA, gloo on CPU). Import
the submodules directly; this package imports nothing on its own (`parallel_config` and
`divisibility` do not import torch, so launch checks stay light).
"""
