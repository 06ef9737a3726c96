"""Kernel launch-config search for the fused-MoE and block-FP8 GEMM kernels (`dsctl tune-moe`, `tune-fp8`).

  shapes.py        model config + parallel layout -> the kernel shapes to tune (and their file names)
  search_space.py  the config grid, pruning by resources / block shape / batch size, neighbours
  bench.py         random problems, CUDA-graph timing, successive halving, numerical check
  precompile.py    compiles candidate kernels in parallel worker processes (GPU only)
  runner.py        the per-batch-size loop: progress, resumable partial results, final table
  verify.py        --verify-exhaustive: the staged pick vs the exhaustive best at a few batch sizes
  plan.py          --dry-run: shapes, search-space sizes after pruning, a time estimate
  targets.py       fused-MoE / block-GEMM targets behind one interface
  errors.py        NoGpuError, TuneFailed

Import submodules directly; this package imports nothing heavy on its own.
"""
