#!/usr/bin/env bash
# Pack FlashInfer (an optional dependency) small enough to carry to a lent GPU machine that has no
# network. The flashinfer-python wheel is 62 MB zipped / 426 MB unpacked, mostly CUDA sources of
# kernels dsctl does not use; the MLA wrapper needs the Python package, FlashInfer's headers, the
# vendored CUTLASS / CCCL / spdlog headers and the batch_mla* / batch_prefill* sources it JIT-compiles.
# Usage (on a machine with pip and network to PyPI):  bash benchmarks/flashinfer_bundle.sh [VERSION]
# Writes .whl/flashinfer-VERSION.tar.xz and the apache-tvm-ffi wheel beside it (.whl/ is git-ignored).
# On the GPU machine:  tar xJf .whl/flashinfer-*.tar.xz -C /tmp/site && pip install --no-deps
#   --target /tmp/site .whl/apache_tvm_ffi-*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-0.7.2.post1}
out=.whl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
python3 -m pip download -q --no-deps -d "$work" "flashinfer-python==$version"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$out" "apache-tvm-ffi>=0.1.11,<0.2"
(cd "$work" && python3 -m zipfile -e flashinfer_python-*.whl site >/dev/null)
csrc="$work/site/flashinfer/data/csrc"
# Keep the MLA decode and the batch prefill sources (MLA's expanded prefill: head dims 192 / 128) and the shared
# top-level headers / templates; drop every other kernel source.
find "$csrc" -mindepth 1 -maxdepth 1 ! -name 'batch_mla*' ! -name 'batch_prefill*' ! -name '*.h' ! -name '*.jinja' \
    -exec rm -rf {} +
rm -rf "$work/site/flashinfer/data/cutlass/"{examples,test,tools/library,tools/profiler,python,docs,media} 2>/dev/null || true
find "$work/site" -name '__pycache__' -prune -exec rm -rf {} +
tar -C "$work/site" -cJf "$out/flashinfer-$version.tar.xz" .
ls -la "$out"
