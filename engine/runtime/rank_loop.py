"""An engine rank process: owns one Engine (scheduler + model shard) and runs the forward loop.

The serving process (or an offline `RankedEngine`) starts one such process per GPU rank
through `EngineRanks` (ranks.py); world rank 0 holds two pipes. The loop
drains incoming messages (add / abort / shutdown), runs `scheduler.step()` while there is
work, and after each step rank 0 sends the deltas the scheduler's output processor
gathered (`RequestOutput`: new tokens, log-probs, finishes; the same deltas the offline
Engine collects) with the scheduler's load and KV statistics. Requests carry the serving
process's ids, so deltas go out as they are.

With tensor parallelism every rank runs the same scheduler on the same inputs (a mirror):
each iteration rank 0 broadcasts the messages it received (an empty list as a heartbeat
when idle, so that the others never wait past --dist-timeout), every rank applies them
and steps; the sampled tokens are broadcast from rank 0 inside the step (the runner), and with the
messages rank 0's prefill-cap state (engine/scheduler/prefill_budget.py: it follows measured step
times), so every scheduler makes the same decisions. Only rank 0 talks to the serving process.
When the serving process goes away (pipe EOF) rank 0 tells the others to stop.

With DP attention (engine/distributed/dp_attention.py) the ranks form DP groups, each with its
own scheduler, KV pool and radix cache. Rank 0 still receives every message; its
`DPController` (dp_controller.py) tags each new request with a DP group, and every rank applies
only its group's messages (an abort or a shutdown goes to all). Each iteration the ranks agree
whether any group has work (a max all-reduce); if so every rank steps, agreeing before each forward
on what runs (engine/distributed/dp_attention.py `agree`: groups whose own next forward differs, or
that have none, run idle ones), and then joins the others' remaining forwards until none is left
(engine/distributed/dp_sync.py `DPSync.finish_iteration`), so the ranks' collectives always pair
up, whatever mix of prefill, decode and speculative steps the groups run.
Then rank 0 gathers every group's deltas and stats and sends them as one StepOutputs.

Control messages reach every rank the same way, between two steps: ReportExpertLoad (the summed routing
counts) and StartProfile / StopProfile (torch.profiler on every rank, engine/runtime/profiling.py), each answered
by rank 0 after a collective.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Optional

from engine.args import EngineArgs
from engine.distributed.comm import all_gather_ints, all_reduce_max_int, broadcast_object, gather_objects
from engine.engine import Engine
from engine.errors import DsctlError
from engine.runner.model_runner import timed
from engine.runtime import protocol
from engine.runtime.dp_controller import DPController, waiting_tokens
from engine.runtime.heap import freeze_startup_heap, warn_slow_collections
from engine.runtime.process_clock import process_age_s
from engine.runtime.profiling import RankProfiler, as_json
from engine.sampling import SamplingParams

log = logging.getLogger("dsctl.engine")

HEARTBEAT_S = 1.0  # an idle TP rank 0 broadcasts an empty message list this often
EXPERT_LOAD_EVERY = 64  # --record-expert-load: the routing counts go to the server every this many step outputs
EXIT_STACK_DUMP_S = 20.0  # a rank still exiting this long after its loop ended logs its threads' stacks


def scheduler_stats(scheduler, runner) -> protocol.EngineStats:
    """Load, memory and prefix-cache figures."""
    pool, extra = runner.kv_pool, scheduler.stats()
    running = len(scheduler.running) + extra["prefilling"]  # + a chunked prefill in progress
    return protocol.EngineStats(running=running, waiting=len(scheduler.waiting), kv_total_tokens=int(pool.size),
                                kv_free_tokens=int(pool.available()),
                                kv_evictable_tokens=extra["prefix_cache_evictable_tokens"],
                                prefix_cache_tokens=extra["prefix_cache_tokens"],
                                prefix_cache_hit_rate=extra["prefix_cache_hit_rate"],
                                retracted_requests=extra["retracted_requests"],
                                spec_accept_hist=extra.get("spec_accept_hist", ()),
                                spec_plain_steps=extra.get("spec_plain_steps", 0),
                                two_batch_forwards=runner.two_batch_forwards,
                                forward_paths=dict(runner.forward_paths),
                                step_seconds=extra.get("step_seconds", {}))


class EngineLoop:
    """Message handling around one Engine; rank 0 sends the scheduler's deltas after every step."""

    def __init__(self, engine, outbox: Optional[Connection]):
        self.engine = engine
        self.outbox = outbox  # None on TP ranks other than 0
        self.tp = engine.runner.parallel.tp
        self.dp = self.tp.dp_size > 1
        self._deferred: list = []  # DP attention: messages for the serving process, sent through rank 0
        self.sent_outputs = 0  # step outputs sent (every rank counts the same: they send in step)
        runner = engine.runner
        self.profiler = RankProfiler(engine.args.server.profile_dir or "", runner.parallel.world_rank, runner.device)
        self.controller = None
        if self.dp and self.tp.is_first:
            self.controller = DPController(self.tp.dp_size, engine.args.parallel.load_balance_method)

    def _send(self, msg) -> None:
        if self.dp:
            self._deferred.append(msg)
        elif self.outbox is not None:
            self.outbox.send(msg)

    def handle(self, msg) -> bool:
        """Apply one message; False when the loop should stop."""
        if isinstance(msg, protocol.AddRequest):
            self._add(msg)
        elif isinstance(msg, protocol.AbortRequest):
            self.engine.scheduler.abort(msg.rid)
        elif isinstance(msg, protocol.ReportExpertLoad):
            self.report_expert_load()
        elif isinstance(msg, protocol.StartProfile):
            self.profiler.start(msg.stamp, msg.max_steps)
        elif isinstance(msg, protocol.StopProfile):
            self.stop_profile(msg.ran_its_steps)
        elif isinstance(msg, protocol.Shutdown):
            self.engine.scheduler.abort_all()
            self.send_outputs()
            return False
        return True

    def _add(self, msg: protocol.AddRequest) -> None:
        try:
            req = self.engine.make_request(msg.prompt_ids, msg.params, rid=msg.rid, grammar=msg.grammar)
            self.engine.scheduler.add(req)
        except DsctlError as exc:
            self._send(protocol.AddFailed(msg.rid, str(exc), user_error=True))
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the engine down
            log.exception("adding request %s failed", msg.rid)
            self._send(protocol.AddFailed(msg.rid, f"internal error: {exc}", user_error=False))

    def step(self) -> None:
        stepped = self.engine.scheduler.has_work()
        if stepped:
            self.engine.scheduler.step()
        if stepped or self.dp:  # DP attention: a group without work runs idle forwards in the same iteration
            self.profiler.count_step()

    def report_expert_load(self) -> None:
        """Every rank at the same point (a collective): the summed routing counts; rank 0 sends them."""
        report = self.engine.runner.expert_load_report()
        if self.outbox is not None:
            self.outbox.send(protocol.ExpertLoadUpdate(report))

    def stop_profile(self, ran_its_steps: bool = False) -> None:
        """Every rank at the same point (a collective): write its profile; rank 0 sends every rank's summary. No
        profile active (it already ran its steps): nothing to do, on every rank alike."""
        if not self.profiler.active:
            return
        stamp = self.profiler.stamp
        every = gather_objects(self.profiler.stop(), self.tp)
        if self.outbox is not None:
            self.outbox.send(protocol.ProfileWritten(stamp, as_json(every), ran_its_steps))

    def send_outputs(self) -> None:
        """Send the deltas gathered since the last call, and the stats (and, every EXPERT_LOAD_EVERY calls, the
        routing counts when they are recorded)."""
        self.sent_outputs += 1
        if self.sent_outputs % EXPERT_LOAD_EVERY == 0 and self.engine.runner.records_expert_load:
            self.report_expert_load()
        outputs = self.engine.scheduler.take_outputs()
        stats = scheduler_stats(self.engine.scheduler, self.engine.runner)
        if self.dp:
            self._send_dp_outputs(outputs, stats)
        elif self.outbox is not None:
            self.outbox.send(protocol.StepOutputs(outputs, stats))

    def _send_dp_outputs(self, outputs, stats) -> None:
        """DP attention (a collective): rank 0 gathers each group leader's deltas, stats and messages."""
        mine = None
        if self.tp.attention.is_first:
            stats.waiting_tokens = waiting_tokens(self.engine.scheduler.waiting)  # what total_tokens weighs
            mine = (outputs, stats, self._deferred)
        self._deferred = []
        every = gather_objects(mine, self.tp)
        if every is None or self.outbox is None:
            return
        leaders = [x for x in every if x is not None]
        for _, _, msgs in leaders:
            for msg in msgs:
                self.outbox.send(msg)
        merged = [out for outs, _, _ in leaders for out in outs]
        self.outbox.send(protocol.StepOutputs(merged, self.controller.merge_stats([s for _, s, _ in leaders])))

    def run(self, inbox: Optional[Connection]) -> None:
        if self.dp:
            self._run_dp(inbox)
            return
        if self.tp.size > 1:
            self._run_mirrored(inbox)
            return
        while True:
            busy = self.engine.scheduler.has_work()
            got_any = False
            # Block while idle; never block while there is work to step.
            while inbox.poll(0 if busy or got_any else None):
                got_any = True
                if not self.handle(inbox.recv()):
                    return
            if busy or got_any:
                self.step()
                self.send_outputs()
            if self.profiler.due:
                self.stop_profile(ran_its_steps=True)

    def _run_mirrored(self, inbox: Optional[Connection]) -> None:
        """The TP loop: rank 0's messages reach every rank in the same order before the same step, with rank 0's
        prefill-cap state (it follows measured step times, which differ per rank)."""
        budget = self.engine.scheduler.prefill_budget
        while True:
            busy = self.engine.scheduler.has_work()
            sent = (self._drain(inbox, busy), budget.state()) if self.tp.is_first else None
            msgs, state = broadcast_object(sent, 0, self.tp)
            budget.set_state(state)
            for msg in msgs:
                if not self.handle(msg):
                    return
            if busy or msgs:
                self.step()
                self.send_outputs()

    def _run_dp(self, inbox: Optional[Connection]) -> None:
        """The DP-attention loop: rank 0 routes each message to a DP group; all groups step together."""
        runner, busy = self.engine.runner, False
        while True:
            routed = None
            if self.tp.is_first:
                routed = [(self.controller.route(m), m) for m in self._drain(inbox, busy)]
            routed = broadcast_object(routed, 0, self.tp)
            go_on = all([self.handle(m) for g, m in routed if g is None or g == self.tp.dp_rank])
            if not go_on:
                return
            busy = bool(all_reduce_max_int(int(self.engine.scheduler.has_work()), self.tp))
            if busy:
                if self.tp.attention.size > 1:  # the group's ranks mirror its scheduler: one prefill-cap state
                    budget = self.engine.scheduler.prefill_budget
                    budget.set_state(broadcast_object(budget.state(), 0, self.tp.attention))
                self.step()
                runner.dp.finish_iteration()
            if busy or routed:
                self.send_outputs()

    def _drain(self, inbox: Connection, busy: bool) -> list:
        """Rank 0: what arrived (waiting up to HEARTBEAT_S when idle); a closed pipe reads as Shutdown."""
        msgs, timeout = [], 0 if busy else HEARTBEAT_S
        try:
            while inbox.poll(timeout):
                msgs.append(inbox.recv())
                timeout = 0
        except (EOFError, OSError):
            msgs.append(protocol.Shutdown())
        if self.profiler.due:  # the profile ran its steps: every rank stops it at the same point
            msgs.append(protocol.StopProfile(ran_its_steps=True))
        return msgs


WARM_UP_PROMPTS = (8, 256, 1024)  # prompt lengths of the warm-up generations (at most the step budget)


def _warm_up(engine) -> None:
    """Short generations before reporting ready, one at a time: the first real request does not pay for lazy
    init, and the prefill cap (engine/scheduler/prefill_budget.py) starts with extend steps of three sizes
    and decode steps measured, so that it holds from the first burst of prompts on."""
    runner, vocab = engine.runner, engine.config.vocab_size
    most = min(engine.args.group_step_budget(), runner.max_model_len - 8, runner.kv_pool.size // 4)
    lengths = sorted({max(1, min(n, most)) for n in WARM_UP_PROMPTS})
    for n in lengths:
        engine.generate(input_ids=[[1 + i % (vocab - 1) for i in range(n)]],
                        sampling_params=SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))


def _log_startup(rank: int, entered_after: Optional[float], phases: dict) -> None:
    """One line per rank: where its start-up went before serving (the runner's own phases are logged above)."""
    parts = ([f"Python and imports {entered_after:.1f} s"] if entered_after is not None else []) + \
        [f"{name} {secs:.1f} s" for name, secs in phases.items()]
    log.info("rank %d start-up: %s", rank, ", ".join(parts))


def _dp_pools(runner) -> tuple[int, ...]:
    """DP attention: every DP group's KV pool size (a collective; logged by rank 0); () without DP."""
    tp = runner.parallel.tp
    if tp.dp_size == 1:
        return ()
    every = all_gather_ints(int(runner.kv_pool.size), tp)
    pools = tuple(every[g * tp.attention.size] for g in range(tp.dp_size))
    if tp.is_first:
        log.info("KV cache: %d DP attention groups x %s tokens = %d tokens in all (plain TP over the same ranks "
                 "holds one copy of ~%d)", tp.dp_size, "/".join(map(str, sorted(set(pools)))), sum(pools),
                 min(pools))
    return pools


def engine_main(local_rank: int, args: EngineArgs, inbox: Optional[Connection], outbox: Optional[Connection],
                make_engine=None) -> None:
    """Entry point of one spawned engine rank (an `EngineRanks` target). The pipes are used by world rank 0
    only (other ranks, and every rank on nodes other than 0, get None or close theirs). `make_engine(args,
    local_rank)` builds the Engine (default: `Engine`; tests wrap it)."""
    # Ctrl-C and a SIGTERM sent to the whole process group are for the serving process to handle:
    # it aborts the requests and tells the ranks to stop (or rank 0 sees the pipe close).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pc = args.parallel.config()
    rank = pc.global_rank(local_rank)
    if rank != 0:
        for conn in (inbox, outbox):
            if conn is not None:
                conn.close()
        inbox = outbox = None
    logging.basicConfig(level=args.server.log_level.upper(),
                        format=f"%(asctime)s engine{'' if pc.world_size == 1 else f' rank {rank}'} %(levelname)s "
                               "%(message)s")
    entered_after = process_age_s()
    try:
        engine = (make_engine or Engine)(args, local_rank=local_rank)
        with timed(engine.startup, "warm-up generations"):
            _warm_up(engine)
        engine.runner.reset_expert_load()  # the counts start with serving
        engine.runner.late_compiles.start_serving()  # a compile from here on stalls a request's step
        _log_startup(rank, entered_after, engine.startup)
        freeze_startup_heap(f"rank {rank}")
        warn_slow_collections(f"rank {rank}")
    except BaseException as exc:  # noqa: BLE001 - report any startup failure to the server
        msg = str(exc) if isinstance(exc, DsctlError) else traceback.format_exc()
        if outbox is None:
            raise  # the supervisor reports this rank's error
        outbox.send(protocol.EngineFailed(f"engine failed to start: {msg}"))
        sys.exit(1)
    runner = engine.runner
    dp_pools = _dp_pools(runner)
    if outbox is not None:
        outbox.send(protocol.EngineInfo(max_model_len=runner.max_model_len, vocab_size=engine.config.vocab_size,
                                        kv_total_tokens=sum(dp_pools) if dp_pools else int(runner.kv_pool.size),
                                        max_running_requests=args.scheduler.max_running_requests, pid=os.getpid(),
                                        dp_kv_tokens=dp_pools))
    loop = EngineLoop(engine, outbox)
    try:
        loop.run(inbox)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the serving process is gone
    except BaseException:  # noqa: BLE001
        if outbox is None:
            raise  # the supervisor reports this rank's error
        try:
            outbox.send(protocol.EngineFailed(f"engine process crashed:\n{traceback.format_exc()}"))
        finally:
            sys.exit(1)
    finally:
        # If this rank is still here EXIT_STACK_DUMP_S from now, its log shows where its exit hangs (the
        # serving process stops ranks that outlive a shutdown request by 30 s).
        faulthandler.dump_traceback_later(EXIT_STACK_DUMP_S, exit=False)
        runner.close()
        runner.parallel.destroy()
