"""Run the engine as one process per GPU rank from an ordinary (front-end) process.

`check_launch(args, resolved)` is what every launcher runs before any weight is read: the
parallel flags against this machine (ranks vs visible GPUs), the TP size against the model
(heads, intermediate sizes, FP8 blocks) and, on CUDA, whether the weights and some KV fit
(with the bytes needed and flags that would fit). `open_engine(args)` returns an `Engine`
for --tp 1 and a `RankedEngine` otherwise: both offer `generate()`, `tokenizer`,
`config` and `close()`.

`RankedEngine` starts the ranks (engine/server/engine_process.py, the same processes
`dsctl serve` runs) and talks to rank 0 over two pipes with the serving protocol
(engine/server/protocol.py): add requests, collect their deltas, build the outputs
exactly as the one-process Engine does. A rank that fails ends the call with a
`EngineRankError` naming it.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
from typing import Optional, Sequence, Union

from engine.args import EngineArgs
from engine.errors import DsctlError, RequestError, UsageError
from engine.resolve import ResolvedModel, resolve_model
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)

POLL_S = 0.2


class EngineRankError(DsctlError):
    """An engine rank failed (its message names the rank and its error)."""


def failure_reason(root, rank0_report: Optional[str]) -> str:
    """What to tell the user when the ranks stopped: the supervisor's root cause (a RankFailure, the
    rank that failed first) unless it is rank 0 itself and rank 0 sent its own report."""
    if root is not None and not (root.rank == 0 and rank0_report):
        return f"engine {root.message()}"
    return rank0_report or "the engine's rank 0 exited"


def fp8_kept(args: EngineArgs, resolved: ResolvedModel, device_type: str) -> Optional[tuple[int, int]]:
    """The FP8 block the weights keep on this device (None when they are dequantised, as on CPU)."""
    cfg, q = resolved.config, args.model.quantization
    if device_type != "cuda" or q == "none":
        return None
    if cfg.fp8 is not None:
        return (cfg.fp8.block_n, cfg.fp8.block_k)
    return (128, 128) if q == "fp8" else None


def check_launch(args: EngineArgs, resolved: Optional[ResolvedModel] = None) -> ResolvedModel:
    """Reject, before any weight is read, a parallel layout this machine or this model cannot run."""
    import torch

    from engine.distributed.parallel_config import check_model_divisible
    from engine.runner import pick_device
    from engine.speculative.draft_model import check_spec_launch

    args.validate()
    resolved = resolved or resolve_model(args.model)
    device = pick_device(args.model.device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else None
    pc = dp_attention_span(args, device.type, gpus).parallel.config()
    pc.validate(device.type, gpus)
    if pc.dp_size > 1 or pc.ep_size > 1:
        log.info("layout: --tp %d, %d DP attention group(s) of %d rank(s), experts %s", pc.tp_size, pc.dp_size,
                 pc.attn_tp_size, f"split whole over {pc.ep_size} EP ranks" if pc.ep_size > 1 else "TP-split")
    cfg = resolved.config
    if args.model.num_layers:
        cfg = cfg.with_num_layers(args.model.num_layers)
    block = fp8_kept(args, resolved, device.type)
    check_spec_launch(args, resolved)
    if pc.tp_size > 1:
        check_model_divisible(cfg, pc.tp_size, block, ep_size=pc.ep_size, attn_tp_size=pc.attn_tp_size)
    if device.type == "cuda":
        _check_fits(args, cfg, block, pc, torch.cuda.get_device_properties(pc.gpu_id(0)).total_memory)
    return resolved


def dp_attention_span(args: EngineArgs, device_type: str, gpus: Optional[int]) -> EngineArgs:
    """`--enable-dp-attention` with no --tp / --dp spans every visible GPU (tp = dp = GPU count), as
    SGLang's does; on one GPU or on CPU that is one rank, which is plain attention (said at start-up)."""
    p = args.parallel
    if not p.enable_dp_attention or p.tp_size != 1 or p.dp_size != 1:
        return args
    if (gpus or 1) > 1:
        log.warning("--enable-dp-attention with no --tp: spanning the %d visible GPUs (--tp %d --dp %d)",
                    gpus, gpus, gpus)
        return args.replace(tp_size=gpus, dp_size=gpus)
    log.warning("--enable-dp-attention on %s: one rank, so DP attention is the same as plain attention",
                "one GPU" if device_type == "cuda" else "CPU")
    return args


def _check_fits(args: EngineArgs, cfg, block, pc, gpu_bytes: int) -> None:
    from engine.distributed.sizing import Layout, check_fits

    kv_bytes = 1 if args.cache.kv_cache_dtype != "auto" else 2
    dtype_bytes = 4 if args.model.dtype == "float32" else 2
    layout = Layout(pc.tp_size, gpu_bytes, args.cache.mem_fraction_static, dtype_bytes, block, kv_bytes,
                    include_mtp=bool(cfg.num_nextn_predict_layers), gpus_per_node=max(1, pc.ranks_per_node),
                    attn_tp_size=pc.attn_tp_size, ep_size=pc.ep_size)
    check_fits(cfg, layout, min_kv_tokens=1024, name=args.model.model)


def launch_args(args: EngineArgs) -> EngineArgs:
    """The flags the ranks start with: `--enable-dp-attention` alone becomes --tp = --dp = visible GPUs."""
    import torch

    from engine.runner import pick_device

    device = pick_device(args.model.device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else None
    return dp_attention_span(args, device.type, gpus)


def open_engine(args: EngineArgs):
    """An Engine (one process) or a RankedEngine (--tp > 1), checked before any weight is read."""
    args = launch_args(args)
    resolved = check_launch(args)
    if args.parallel.config().world_size == 1:
        from engine.engine import Engine

        return Engine(args)
    return RankedEngine(args, resolved)


class RankedEngine:
    """--tp N engine ranks driven from this process (offline generation, tests). `rank_main`: each rank's
    entry point (default `engine_main`; tests pass it a `make_engine`)."""

    def __init__(self, args: EngineArgs, resolved: Optional[ResolvedModel] = None, rank_main=None):
        from engine.distributed.launch import start_ranks, with_local_init_addr
        from engine.server.engine_process import engine_main
        from engine.server.protocol import EngineInfo
        from engine.tokenizer import load_tokenizer

        args = launch_args(args)
        resolved = check_launch(args, resolved)
        pc = args.parallel.config()
        if pc.nnodes > 1:
            raise UsageError("offline generation runs on one node; use `dsctl serve` for --nnodes > 1")
        pc = with_local_init_addr(pc)
        self.args = args.replace(dist_init_addr=pc.dist_init_addr)
        self.tokenizer = load_tokenizer(resolved.tokenizer_path)
        self.config = resolved.config
        ctx = mp.get_context("spawn")
        to_r, self._to = ctx.Pipe(duplex=False)
        self._from, from_w = ctx.Pipe(duplex=False)
        self._ranks = start_ranks(rank_main or engine_main, pc.ranks_per_node, (self.args, to_r, from_w))
        to_r.close()
        from_w.close()
        self._ids = itertools.count()
        self.info = self._receive(EngineInfo)
        self.stats = None  # the EngineStats of rank 0's latest step outputs

    # ---- protocol --------------------------------------------------------------
    def _next(self):
        """The next message from rank 0; EngineRankError when a rank failed."""
        from engine.server.protocol import EngineFailed

        while True:
            failure = self._ranks.poll()
            if failure is not None:
                raise EngineRankError(f"engine {failure.message()}")
            try:
                if not self._from.poll(POLL_S):
                    continue
                msg = self._from.recv()
            except (EOFError, OSError):
                msg = None
            if msg is None or isinstance(msg, EngineFailed):
                report = msg.message if msg is not None else None
                try:
                    root = self._ranks.wait(timeout=10.0)
                except TimeoutError:
                    self._ranks.stop()
                    root = self._ranks.root
                raise EngineRankError(failure_reason(root, report))
            return msg

    def _receive(self, kind):
        while True:
            msg = self._next()
            if isinstance(msg, kind):
                return msg

    # ---- generation ----------------------------------------------------------
    def generate(
        self,
        prompts: Union[str, Sequence[str], None] = None,
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        input_ids: Optional[Sequence[Sequence[int]]] = None,
        dp_rank: Optional[int] = None,
    ):
        """Same contract as Engine.generate: outputs in input order. `dp_rank` (DP attention): send every
        request to that DP group instead of letting the controller spread them."""
        from engine.engine import build_output, per_prompt, prompt_token_lists
        from engine.scheduler.output import CollectedOutput
        from engine.server.protocol import AddFailed, AddRequest, StepOutputs

        token_lists = prompt_token_lists(prompts, input_ids, self.encode)
        params = per_prompt(sampling_params, len(token_lists))
        rids = [f"g{next(self._ids)}" for _ in token_lists]
        for rid, ids, p in zip(rids, token_lists, params):
            self._to.send(AddRequest(rid, ids, p.validate(), dp_rank=dp_rank))
        collected = {rid: CollectedOutput() for rid in rids}
        left = set(rids)
        while left:
            msg = self._next()
            if isinstance(msg, AddFailed) and msg.rid in collected:
                raise (RequestError if msg.user_error else EngineRankError)(msg.message)
            if isinstance(msg, StepOutputs):
                self.stats = msg.stats
                for out in msg.outputs:
                    if out.rid in collected:
                        collected[out.rid].add(out)
                        if out.finished:
                            left.discard(out.rid)
        return [build_output(ids, p, collected[rid], self._decode) for rid, ids, p in zip(rids, token_lists, params)]

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise UsageError(f"{self.args.model.model} has no tokenizer files here; pass token ids instead of text")
        return self.tokenizer.encode(text)

    def _decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special) if self.tokenizer else ""

    def spec_accept_hist(self) -> tuple[int, ...]:
        """As Engine.spec_accept_hist, as of the latest step outputs (those of a finished generate call
        include its last step); every DP group's steps added up."""
        return tuple(self.stats.spec_accept_hist) if self.stats is not None else ()

    # ---- lifecycle -----------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """The rank processes' pids, rank order."""
        return list(self._ranks.pids)

    def alive(self) -> list[int]:
        """Pids of the ranks still running."""
        return self._ranks.alive()

    def close(self, timeout: float = 30.0) -> None:
        """Stop every rank (cleanly when they answer, else by signal); idempotent."""
        from engine.server.protocol import Shutdown

        if self._ranks.stopped:
            return
        try:
            self._to.send(Shutdown())
            self._ranks.wait(timeout=timeout)
        except OSError:
            pass
        except TimeoutError:
            log.warning("engine ranks did not exit within %.0fs of the shutdown request; stopping them", timeout)
        self._ranks.stop()
        self._to.close()
        self._from.close()

    def __enter__(self) -> "RankedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
