"""Grouped ("super-grouped") tile order shared by the GEMM kernels: consecutive programs walk
GROUP_SIZE_M row tiles down one column of tiles before moving right, so the B tiles they load
stay in L2 across neighbouring programs."""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_SIZE_M: tl.constexpr):
    """(row tile, column tile) for program `pid`."""
    group = GROUP_SIZE_M * num_pid_n
    first_m = (pid // group) * GROUP_SIZE_M
    group_m = min(num_pid_m - first_m, GROUP_SIZE_M)
    pid_m = first_m + (pid % group) % group_m
    pid_n = (pid % group) // group_m
    return pid_m, pid_n
