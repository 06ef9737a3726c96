"""Per-rank slicing of real tiny checkpoints (engine/weights/sharding.py).

For TP 2 and 4: every tensor's per-rank slices, read through safetensors' get_slice, put
back together give the full tensor; each rank reads only its share of the elements; FP8
scale slices dequantise each rank's weight slice to exactly the slice of the dequantised
full weight, and block-aligned or sub-block slices also do so through the model's plain
block dequantisation and the Triton block-FP8 GEMM (the kernels accept them as they are).
"""

import json
from contextlib import ExitStack

import pytest
import torch
from safetensors import safe_open

from engine.weights.loader import hf_to_target
from engine.weights.sharding import (
    SliceSpec,
    dequant_slice,
    is_scale,
    local_shape,
    read_for_rank,
    read_fp8_for_rank,
    read_slice,
    shard_spec,
    split_kind,
)
from kernels.fp8_math import FP8_DTYPE, dequant_block_fp8, quantize_block_fp8

BLOCK = (128, 128)


class CountingHandle:
    """A safe_open handle that counts the elements its slices return (to prove partial reads)."""

    def __init__(self, handle):
        self.handle, self.elements = handle, 0

    def get_slice(self, name):
        return CountingSlice(self, self.handle.get_slice(name))


class CountingSlice:
    def __init__(self, owner, sl):
        self.owner, self.sl = owner, sl

    def get_shape(self):
        return self.sl.get_shape()

    def __getitem__(self, index):
        t = self.sl[index]
        self.owner.elements += t.numel()
        return t


class Checkpoint:
    """Open shards of a checkpoint dir, with our parameter name for each HF tensor name."""

    def __init__(self, path, cfg, stack: ExitStack):
        self.cfg = cfg
        self.wmap = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        self.files = {f: CountingHandle(stack.enter_context(safe_open(str(path / f), framework="pt")))
                      for f in set(self.wmap.values())}

    def handle(self, name):
        return self.files[self.wmap[name]]

    def param(self, name):
        t = hf_to_target(name, self.cfg, self.cfg.num_hidden_layers, mtp=True)
        assert t is not None, name
        return t.name

    def full(self, name):
        return self.handle(name).handle.get_tensor(name)

    def elements_read(self):
        return sum(h.elements for h in self.files.values())


@pytest.fixture(params=["tiny", "tiny-fp8"])
def ckpt(request, tiny_ckpt, tiny_fp8_ckpt):
    path, cfg = tiny_ckpt if request.param == "tiny" else tiny_fp8_ckpt
    with ExitStack() as stack:
        yield Checkpoint(path, cfg, stack)


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_slices_concatenate_to_every_full_tensor(ckpt, tp):
    split = replicated = 0
    for name in ckpt.wmap:
        if is_scale(name):
            continue
        param = ckpt.param(name)
        full = ckpt.full(name)
        spec0 = shard_spec(param, full.shape, 0, tp)
        parts = [read_for_rank(ckpt.handle(name), name, param, r, tp) for r in range(tp)]
        if spec0 is None:
            replicated += full.numel()
            assert all(torch.equal(p.view(torch.uint8), full.view(torch.uint8)) for p in parts), name
            continue
        split += full.numel()
        assert all(p.shape[spec0.dim] == full.shape[spec0.dim] // tp for p in parts), name
        whole = torch.cat(parts, spec0.dim)
        assert whole.dtype == full.dtype and torch.equal(whole.view(torch.uint8), full.view(torch.uint8)), name
    assert split > 4 * replicated  # the split tensors dominate: this test is not vacuous
    # every rank read exactly its share: replicated whole, split tensors 1/tp each
    assert ckpt.elements_read() == tp * replicated + split


@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_scale_slices_dequantise_each_rank_exactly(tiny_fp8_ckpt, tp):
    path, cfg = tiny_fp8_ckpt
    checked = sub_block = 0
    with ExitStack() as stack:
        ck = Checkpoint(path, cfg, stack)
        for name in ck.wmap:
            if not name.endswith("weight_scale_inv"):
                continue
            wname = name[: -len("_scale_inv")]
            param = ck.param(wname)
            full = dequant_block_fp8(ck.full(wname), ck.full(name), BLOCK)
            for r in range(tp):
                w, s, spec = read_fp8_for_rank(ck.handle(wname), wname, ck.handle(name), name, param, r, tp, BLOCK)
                assert w.dtype == FP8_DTYPE and s.dtype == torch.float32
                want = full if spec is None else spec.apply(full)
                assert torch.equal(dequant_slice(w, s, spec, BLOCK), want), (name, r)
                # the slices tiny-fp8 makes never straddle a block, so the model's plain dequantisation
                # (scale row = local row // 128) reads them right too
                assert torch.equal(dequant_block_fp8(w, s, BLOCK), want), (name, r)
                sub_block += spec is not None and spec.length < 128
                checked += 1
    assert checked > 100 and sub_block > 10


def test_straddling_slice_needs_the_offset():
    """192-row slices of 128-row blocks: dequant_slice is exact; offset-free dequantisation is not,
    which is why divisibility rejects such splits while weights stay FP8."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 256, generator=g) * torch.linspace(0.1, 10, 384)[:, None]
    q, s = quantize_block_fp8(w, BLOCK)
    full = dequant_block_fp8(q, s, BLOCK)
    spec = shard_spec("layers.0.self_attn.q_b_proj.weight", q.shape, 1, 2)
    sspec = shard_spec("layers.0.self_attn.q_b_proj.weight_scale_inv", s.shape, 1, 2, BLOCK, q.shape)
    assert (spec.start, spec.length, sspec.start, sspec.length) == (192, 192, 1, 2)
    wr, sr = spec.apply(q), sspec.apply(s)
    assert torch.equal(dequant_slice(wr, sr, spec, BLOCK), full[192:])
    assert not torch.equal(dequant_block_fp8(wr, sr, BLOCK), full[192:])


def test_stacked_w13_param_matches_per_expert_halves():
    """The stacked [E, 2N, K] parameter split with pieces=2 equals stacking each expert's split halves."""
    g = torch.Generator().manual_seed(1)
    e, n, k, tp = 3, 256, 128, 2
    gate, up = torch.randn(e, n, k, generator=g), torch.randn(e, n, k, generator=g)
    w13 = torch.cat((gate, up), dim=1)
    for r in range(tp):
        spec = shard_spec("layers.1.mlp.w13", w13.shape, r, tp)
        per = shard_spec("layers.1.mlp.w13", gate.shape[1:], r, tp)
        assert spec.pieces == 2 and per.pieces == 1
        want = torch.cat([per.apply(gate[i])[None] for i in range(e)])
        want_up = torch.cat([per.apply(up[i])[None] for i in range(e)])
        assert torch.equal(spec.apply(w13), torch.cat((want, want_up), dim=1))
        assert local_shape("layers.1.mlp.w13", w13.shape, tp) == (e, n, k)
    q, s = quantize_block_fp8(w13, BLOCK)
    for r in range(tp):
        spec = shard_spec("mtp.layer.mlp.w13", q.shape, r, tp)
        sspec = shard_spec("mtp.layer.mlp.w13_scale", s.shape, r, tp, BLOCK, q.shape)
        assert torch.equal(dequant_block_fp8(spec.apply(q), sspec.apply(s), BLOCK),
                           spec.apply(dequant_block_fp8(q, s, BLOCK)))
    with pytest.raises(ValueError, match="per-expert"):  # 128 / 2 = 64-row halves cannot share a scale row
        shard_spec("layers.1.mlp.w13_scale", (e, 2, 1), 0, 2, BLOCK, (e, 256, 128))


def test_w2_and_vocab_specs():
    assert shard_spec("layers.2.mlp.w2", (16, 256, 128), 1, 4) == SliceSpec(2, 32, 32)
    assert shard_spec("layers.2.mlp.w2_scale", (16, 2, 1), 3, 4, BLOCK, (16, 256, 128)) == SliceSpec(2, 0, 1)
    assert shard_spec("lm_head", (320, 256), 3, 4) == SliceSpec(0, 240, 80)
    assert shard_spec("mtp.head", (320, 256), 1, 2) == SliceSpec(0, 160, 160)
    assert shard_spec("layers.0.self_attn.o_proj.weight", (256, 128), 1, 2) == SliceSpec(1, 64, 64)
    assert shard_spec("layers.0.mlp.gate_weight", (16, 256), 1, 2) is None
    assert shard_spec("layers.0.self_attn.q_b_proj.weight", (256, 128), 0, 1) is None  # TP 1: whole


def test_rules_cover_the_model_and_reject_unknown_names(tiny_fp8_ckpt):
    from engine.model.deepseek import DeepseekForCausalLM, MTPLayer

    _, cfg = tiny_fp8_ckpt
    with torch.device("meta"):
        modules = {"": DeepseekForCausalLM(cfg, torch.bfloat16, BLOCK),
                   "mtp.": MTPLayer(cfg, cfg.num_hidden_layers, torch.bfloat16, BLOCK)}
    names = [p + n for p, m in modules.items() for n, _ in m.named_parameters()]
    kinds = {split_kind(n) for n in names}
    assert kinds == {"replicated", "rows", "cols", "vocab", "w13", "w2"}
    with pytest.raises(KeyError, match="no tensor-parallel rule"):
        split_kind("layers.0.self_attn.new_proj.weight")
    with pytest.raises(ValueError, match="does not split 3 ways"):
        shard_spec("layers.0.self_attn.q_b_proj.weight", (256, 128), 0, 3)


def test_read_slice_whole_and_pieces(tmp_path):
    from safetensors.torch import save_file

    t = torch.arange(4 * 6 * 2, dtype=torch.float32).view(4, 6, 2)
    save_file({"x": t}, str(tmp_path / "a.safetensors"))
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        assert torch.equal(read_slice(f, "x", None), t)
        spec = SliceSpec(dim=1, start=1, length=2, pieces=2)
        assert torch.equal(read_slice(f, "x", spec), spec.apply(t))
        assert torch.equal(read_slice(f, "x", spec), t[:, [1, 2, 4, 5]])


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton-interpreter check on CPU tensors")
def test_block_gemm_accepts_sub_block_rank_slices(tiny_fp8_ckpt):
    """TP 4 q_b_proj (64 rows of a 128-row block) and TP 2 o_proj (64 columns): the Triton block-FP8
    GEMM runs on the rank's own (weight, scale) and matches its reference on the exact rank weight."""
    from kernels.fp8 import block_fp8_matmul, block_fp8_matmul_ref

    path, cfg = tiny_fp8_ckpt
    with ExitStack() as stack:
        ck = Checkpoint(path, cfg, stack)
        for wname, tp, rank in (("model.layers.1.self_attn.q_b_proj.weight", 4, 1),
                                ("model.layers.1.self_attn.o_proj.weight", 2, 1)):
            sname = wname + "_scale_inv"
            w, s, spec = read_fp8_for_rank(ck.handle(wname), wname, ck.handle(sname), sname, ck.param(wname),
                                           rank, tp, BLOCK)
            assert spec.length == 64 and s.shape[spec.dim] == 1
            x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(tp))
            got = block_fp8_matmul(x, w, s, BLOCK)
            ref = block_fp8_matmul_ref(x, w, s, BLOCK)
            assert not got.isnan().any()
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            exact = x.double() @ dequant_slice(w, s, spec, BLOCK).double().T
            assert ((got.double() - exact).norm() / exact.norm()).item() < 0.06  # within the e4m3 activation error


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_algebra_reproduces_the_full_layers(tiny_ckpt, tp):
    """In one process, the per-rank slices combined the way TP combines them (sum for row-parallel
    outputs, concatenation for heads and vocab) give the unsplit layers' results: this checks the
    split direction of every rule, which concatenating slices back alone cannot."""
    import torch.nn.functional as F

    path, cfg = tiny_ckpt
    g = torch.Generator().manual_seed(tp)
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    x = torch.randn(5, h, generator=g)

    with ExitStack() as stack:
        ck = Checkpoint(path, cfg, stack)

        def parts(name):
            return [read_for_rank(ck.handle(name), name, ck.param(name), r, tp).float() for r in range(tp)]

        def full(name):
            return ck.full(name).float()

        def mlp_pair(prefix):
            names = [f"{prefix}{p}_proj.weight" for p in ("gate", "up", "down")]
            gate, up, down = (full(n) for n in names)
            want = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
            got = sum(F.linear(F.silu(F.linear(x, gr)) * F.linear(x, ur), dr)
                      for gr, ur, dr in zip(*(parts(n) for n in names), strict=True))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

        mlp_pair("model.layers.0.mlp.")  # dense
        mlp_pair("model.layers.1.mlp.experts.5.")  # routed expert: w13 halves and w2
        mlp_pair("model.layers.1.mlp.shared_experts.")
        mlp_pair(f"model.layers.{cfg.num_hidden_layers}.mlp.experts.0.")  # MTP layer

        per = heads // tp
        a = "model.layers.2.self_attn."
        for name, width, src in (("q_b_proj", cfg.qk_head_dim, torch.randn(5, cfg.q_lora_rank, generator=g)),
                                 ("kv_b_proj", cfg.qk_nope_head_dim + cfg.v_head_dim,
                                  torch.randn(5, cfg.kv_lora_rank, generator=g))):
            want = F.linear(src, full(a + name + ".weight")).view(5, heads, width)
            for r, w in enumerate(parts(a + name + ".weight")):
                torch.testing.assert_close(F.linear(src, w).view(5, per, width), want[:, r * per:(r + 1) * per])
        v = torch.randn(5, heads, cfg.v_head_dim, generator=g)
        want = F.linear(v.reshape(5, -1), full(a + "o_proj.weight"))
        got = sum(F.linear(v[:, r * per:(r + 1) * per].reshape(5, -1), w)
                  for r, w in enumerate(parts(a + "o_proj.weight")))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

        vocab = cfg.vocab_size // tp
        ids = torch.randint(0, cfg.vocab_size, (7,), generator=g)
        emb = torch.zeros(7, h)
        for r, w in enumerate(parts("model.embed_tokens.weight")):  # vocab-parallel embedding: mask, look up, sum
            local = ids - r * vocab
            mine = (local >= 0) & (local < vocab)
            emb += F.embedding(local.clamp(0, vocab - 1), w) * mine[:, None]
        assert torch.equal(emb, full("model.embed_tokens.weight")[ids])
        logits = torch.cat([F.linear(x, w) for w in parts("lm_head.weight")], dim=-1)  # gathered in rank order
        torch.testing.assert_close(logits, F.linear(x, full("lm_head.weight")))
