"""Occupancy arithmetic for sm_90 (kernels/occupancy.py), against hand-computed cases, and the report's walk
over a Triton function's compiled-kernel caches (a stand-in cache here: on CPU nothing is compiled)."""

from types import SimpleNamespace

from kernels.occupancy import KernelUsage, compiled_kernels, kernel_report, occupancy, report_lines


def test_register_limited():
    # 255 regs -> 8192 per warp (255 * 32 = 8160, rounded up to 256s); 8 warps -> 65536: one block, 8/64 warps
    assert occupancy(255, 0, 8) == (1, 0.125)
    # 128 regs -> 4096 per warp; 4 warps -> 16384: four blocks, 16/64 warps
    assert occupancy(128, 0, 4) == (4, 0.25)


def test_shared_memory_limited():
    # 100 KB + 1 KB reserved per block: two blocks fit in 228 KB
    assert occupancy(32, 100 * 1024, 4) == (2, 0.125)
    assert occupancy(32, 230 * 1024, 4) == (0, 0.0)  # does not fit at all


def test_thread_and_block_limited():
    assert occupancy(16, 0, 16) == (4, 1.0)  # 2048 threads / 512
    assert occupancy(16, 0, 1) == (32, 0.5)  # at most 32 blocks per SM


def test_report_walks_the_device_caches_of_a_wrapped_function():
    k = SimpleNamespace(metadata=SimpleNamespace(name="_k", shared=64 * 1024, num_warps=8), n_regs=168, n_spills=0)
    fn = SimpleNamespace(device_caches={0: ({"key": k}, {}, "target", "backend", None)})
    wrapper = SimpleNamespace(fn=fn)  # an autotuner holds the JIT function in .fn
    assert compiled_kernels(wrapper) == [k]
    [u] = kernel_report(wrapper)
    assert u == KernelUsage("_k", 168, 0, 64 * 1024, 8)
    assert u.occupancy() == (1, 0.125)  # 168 regs x 32 = 5376 per warp, 8 warps = 43008: one block
    lines = report_lines({"stand-in": wrapper})
    assert len(lines) == 2 and lines[1].split()[-3:] == ["1", "12%", "1"]
    assert kernel_report(SimpleNamespace()) == []
