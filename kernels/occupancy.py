"""Registers, spills, shared memory and occupancy of compiled Triton kernels (the profile a missed kernel
target reports, issue 16).

`kernel_report(jit_fn)` lists every specialisation of a Triton JIT function compiled in this process
(read from the function's per-device caches, so the kernel must have been launched first) with its
registers per thread, spilled bytes, shared memory and warps, and `occupancy` turns those into resident
blocks per SM and the fraction of the SM's 64 warp slots in use, by Hopper's (sm_90) limits: 64K 32-bit
registers (allocated per warp in units of 256), 2048 threads, 32 blocks and 228 KB of shared memory per SM
(1 KB of it reserved per block). Nothing here launches anything; on CPU (TRITON_INTERPRET) the caches are
empty and the report is too.
"""

from __future__ import annotations

from dataclasses import dataclass

SM90 = dict(regs=65536, threads=2048, blocks=32, smem=233472, smem_per_block_reserved=1024, reg_unit=256,
            max_warps=64)


@dataclass(frozen=True)
class KernelUsage:
    name: str
    n_regs: int  # per thread
    n_spills: int  # bytes spilled per thread
    shared: int  # bytes of shared memory per block
    num_warps: int

    def occupancy(self, limits: dict = SM90) -> tuple[int, float]:
        return occupancy(self.n_regs, self.shared, self.num_warps, limits)


def occupancy(n_regs: int, shared: int, num_warps: int, limits: dict = SM90) -> tuple[int, float]:
    """(resident blocks per SM, fraction of the SM's warp slots they fill) for a kernel using `n_regs`
    registers per thread, `shared` bytes of shared memory per block and `num_warps` warps per block."""
    unit = limits["reg_unit"]
    regs_per_warp = -(-max(n_regs, 1) * 32 // unit) * unit
    by_regs = limits["regs"] // (regs_per_warp * num_warps)
    by_smem = limits["smem"] // (shared + limits["smem_per_block_reserved"]) if shared else limits["blocks"]
    by_threads = limits["threads"] // (32 * num_warps)
    blocks = min(by_regs, by_smem, by_threads, limits["blocks"])
    return blocks, blocks * num_warps / limits["max_warps"]


def compiled_kernels(jit_fn) -> list:
    """The compiled kernels of a Triton JIT function (or an autotuner / heuristics wrapper of one) in this
    process, every device; [] when none (never launched, or interpreted)."""
    while not hasattr(jit_fn, "device_caches") and hasattr(jit_fn, "fn"):
        jit_fn = jit_fn.fn
    out = []
    for entry in getattr(jit_fn, "device_caches", {}).values():
        cache = next((x for x in entry if isinstance(x, dict)), {})  # the layout of the tuple varies by version
        out += [k for k in cache.values() if hasattr(k, "metadata")]
    return out


def kernel_report(jit_fn) -> list[KernelUsage]:
    """KernelUsage of every loaded specialisation of `jit_fn` (n_regs / n_spills exist once it has run)."""
    rows = []
    for k in compiled_kernels(jit_fn):
        md = k.metadata
        rows.append(KernelUsage(getattr(md, "name", "?"), int(getattr(k, "n_regs", -1) or -1),
                                int(getattr(k, "n_spills", 0) or 0), int(getattr(md, "shared", 0)),
                                int(getattr(md, "num_warps", 0))))
    return rows


def report_lines(named: dict) -> list[str]:
    """A table of the loaded specialisations of each {label: jit_fn}: registers, spills, shared, warps, the
    occupancy they allow on sm_90, and how many specialisations share those figures."""
    lines = [f"{'kernel':<34} {'regs':>5} {'spill B':>7} {'smem KB':>7} {'warps':>5} {'blocks/SM':>9} "
             f"{'occupancy':>9} {'kernels':>7}"]
    for label, fn in named.items():
        counts: dict[tuple, int] = {}
        for u in kernel_report(fn):
            if u.n_regs >= 0 and u.num_warps:
                key = (u.n_regs, u.n_spills, u.shared, u.num_warps)
                counts[key] = counts.get(key, 0) + 1
        for (regs, spills, shared, warps), n in sorted(counts.items()):
            blocks, frac = occupancy(regs, shared, warps)
            lines.append(f"{label:<34} {regs:>5} {spills:>7} {shared / 1024:>7.1f} {warps:>5} {blocks:>9} "
                         f"{frac:>8.0%} {n:>7}")
    return lines
