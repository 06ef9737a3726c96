"""GPU-only: the parallel Triton precompile before CUDA-graph capture (engine/runner/triton_precompile.py).

Each case runs in a fresh process with a new, empty Triton cache, so that no kernel is compiled or
cached beforehand. With --triton-compile-workers 2, the recording pass must find the decode path's
kernels, the workers must compile all of them, the capture that follows must compile none itself
(every in-process compile is a cache hit), and greedy output must equal a run without precompile.
The prefill kernels compile in the background; a second start with that cache spawns no worker and
its prefills compile nothing in-process.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import json, sys
sys.path.insert(0, {root!r})
import torch
from triton import knobs
misses = []
knobs.compilation.listener = lambda *, cache_hit, metadata, **_: misses.append((cache_hit, metadata.get("name")))
from engine.engine import Engine
from engine.sampling import SamplingParams
eng = Engine(model="tiny", device="cuda", max_total_tokens=8192, cuda_graph_bs="1,2,4,8",
             triton_compile_workers={workers})
rep = eng.runner.graphs.precompiled
pre = None if rep is None else [rep.kernels, rep.missing, rep.compiled]
at_start = list(misses)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(3, 40, (4,), generator=g)]
out = eng.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
serving = misses[len(at_start):]
bg = eng.runner.prefill_compiles
prefill = None if bg is None else [len(bg.specs), bg.wait()]  # wait: the next start may use them
print("RESULT " + json.dumps({{"misses_at_start": sum(not h for h, _ in at_start),
                              "hits_at_start": sum(h for h, _ in at_start),
                              "missed": sorted({{n for h, n in misses if not h}}),
                              "misses_serving": sum(not h for h, _ in serving), "precompile": pre,
                              "prefill": prefill, "tokens": [o.token_ids for o in out]}}))
"""


def _run(workers: int, tmp_path) -> dict:
    cache = tmp_path / f"cache{workers}"
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    proc = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, workers=workers)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])


def test_precompile_leaves_nothing_for_capture(tmp_path):
    pytest.importorskip("triton.knobs")
    base = _run(0, tmp_path)
    par = _run(2, tmp_path)
    kernels, missing, compiled = par["precompile"]
    assert kernels > 0 and missing == compiled == kernels, par["precompile"]
    assert base["misses_at_start"] > 0  # without precompile, the capture compiles in-process
    assert par["misses_at_start"] == 0, par["missed"]  # with it, every in-process compile loads the workers' binaries
    assert par["hits_at_start"] >= kernels
    assert par["tokens"] == base["tokens"]
    assert par["prefill"][0] > 0 and par["prefill"][0] == par["prefill"][1], par["prefill"]  # all compiled
    again = _run(2, tmp_path)  # the same cache: every kernel is there, no worker is needed
    assert again["precompile"][0] == kernels and again["precompile"][1:] == [0, 0], again["precompile"]
    assert again["prefill"] == [0, 0], again["prefill"]
    assert again["misses_at_start"] == 0 and again["tokens"] == base["tokens"]
    # the prefills of these prompts (4 x 3-40 tokens) found their kernels among the precompiled ones
    assert again["misses_serving"] == 0, again
