"""The HTTP server's streaming path alone: the real app and EngineClient dispatch, with a steady stand-in engine.

Every step (--step-ms) the stand-in emits one token for each running request, as one StepOutputs that goes
through pickle (what crosses the engine pipe) and the client's dispatch on the event loop, as a real engine's
does; `dsctl bench serving` (a subprocess, its own client processes) then measures TTFT / ITL against it.
What the server adds per streamed token (detokenisation, metrics, JSON, SSE, the HTTP writes) shows as its
process's CPU seconds per token and as ITL spread: with a perfectly steady engine, ITL p50 should equal the
step and p99 stay near it; bunched chunks (ITL p50 near 0) mean the server fell behind.

    python3 benchmarks/bench_stream_path.py --concurrency 256 --step-ms 20 --output-len 256
    python3 benchmarks/bench_stream_path.py --loop uvloop --http httptools ...   (uvicorn's faster loop / parser)
    python3 benchmarks/bench_stream_path.py --in-process --concurrency 256 --output-len 64
        (no sockets, no client: the app called over ASGI with a send that drops the chunks, one step's outputs
        dispatched at a time, each step's chunks all written before the next; CPU per token of the Python path)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import queue
import resource
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.args import EngineArgs  # noqa: E402
from engine.checkpoint.resolve import resolve_model  # noqa: E402
from engine.checkpoint.tokenizer import load_tokenizer  # noqa: E402
from engine.runtime.client import EngineClient  # noqa: E402
from engine.runtime.heap import freeze_startup_heap  # noqa: E402
from engine.runtime.protocol import AbortRequest, AddRequest, EngineInfo, EngineStats, StepOutputs  # noqa: E402
from engine.scheduler.output import RequestOutput  # noqa: E402
from engine.server.app import build_app  # noqa: E402


class SteadyEngine(EngineClient):
    """An EngineClient whose 'engine' is a thread here: one token per running request every `step_s`."""

    def __init__(self, args: EngineArgs, step_s: float, vocab: int):
        super().__init__(args)
        self.step_s, self.vocab = step_s, vocab
        self.steps = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.ready = asyncio.Event()
        self.info = EngineInfo(max_model_len=8192, vocab_size=self.vocab, kv_total_tokens=1 << 22,
                               max_running_requests=4096, pid=os.getpid())
        self.ready.set()
        if self.step_s > 0:  # 0: no engine thread; the caller delivers the steps (--in-process)
            threading.Thread(target=self._engine, name="steady-engine", daemon=True).start()

    def deliver(self, msg) -> None:
        """On the event loop: one message as the reader thread would hand it over."""
        self._dispatch(msg)

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._outq.put(None)

    def _engine(self) -> None:
        running: dict[str, int] = {}  # rid -> tokens still to send
        nxt = time.perf_counter()
        while True:
            try:
                while True:
                    msg = self._outq.get_nowait()
                    if msg is None:
                        return
                    if isinstance(msg, AddRequest):
                        running[msg.rid] = msg.params.max_new_tokens
                    elif isinstance(msg, AbortRequest):
                        running.pop(msg.rid, None)
            except queue.Empty:
                pass
            outs = []
            for rid, left in list(running.items()):
                done = left == 1
                outs.append(RequestOutput(rid, new_token_ids=[1000 + (left * 7919) % (self.vocab - 2000)],
                                          finish_reason="length" if done else None))
                running[rid] = left - 1
                if done:
                    del running[rid]
            if outs:
                msg = pickle.loads(pickle.dumps(StepOutputs(outs, EngineStats(running=len(running)))))
                self._call(self._dispatch, msg)
                self.steps += 1
            nxt += self.step_s
            time.sleep(max(0.0, nxt - time.perf_counter()))


def serve(opts, port: int) -> None:
    import uvicorn  # lazy: only the server side of this script needs it

    args = EngineArgs.of(model="deepseek-v3", load_format="dummy", port=port)
    tokenizer = load_tokenizer(resolve_model(args.model).tokenizer_path)
    client = SteadyEngine(args, opts.step_ms / 1000, getattr(tokenizer, "vocab_size", 129280))
    app = build_app(args, tokenizer, client)
    freeze_startup_heap("server")  # as dsctl serve does before it serves
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop=opts.loop, http=opts.http)


def in_process(opts) -> None:
    """The app's own per-token work, measured in this process (see the module docstring)."""
    args = EngineArgs.of(model="deepseek-v3", load_format="dummy")
    tokenizer = load_tokenizer(resolve_model(args.model).tokenizer_path)
    client = SteadyEngine(args, 0.0, getattr(tokenizer, "vocab_size", 129280))  # no thread: steps delivered below
    app = build_app(args, tokenizer, client)
    freeze_startup_heap("server")
    body = json.dumps({"model": "deepseek-v3", "prompt": "hello there", "max_tokens": opts.output_len,
                       "stream": True, "ignore_eos": True}).encode()
    chunks = [0]

    async def one() -> None:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},  # what uvicorn sends
                 "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/v1/completions",
                 "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
        sent, never = [False], asyncio.Event()

        async def receive():
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()  # the client never leaves

        async def send(msg) -> None:
            chunks[0] += msg["type"] == "http.response.body" and bool(msg.get("body"))

        await app(scope, receive, send)

    async def run() -> None:
        async with app.router.lifespan_context(app):
            tasks = [asyncio.create_task(one()) for _ in range(opts.concurrency)]
            while len(client.pending) < opts.concurrency:
                await asyncio.sleep(0.01)
            rids, tokens = sorted(client.pending), 0
            cpu = time.process_time()
            for step in range(opts.output_len):
                last = step == opts.output_len - 1
                outs = [RequestOutput(rid, new_token_ids=[1000 + (step * 7919 + i) % 120000],
                                      finish_reason="length" if last else None) for i, rid in enumerate(rids)]
                client.deliver(pickle.loads(pickle.dumps(StepOutputs(outs, EngineStats(running=len(rids))))))
                tokens += len(outs)
                for _ in range(8):  # every stream writes its chunk before the next step
                    await asyncio.sleep(0)
            await asyncio.gather(*tasks)
            cpu = time.process_time() - cpu
        print(f"in-process, loop={opts.loop}: conc={opts.concurrency} out={opts.output_len}: "
              f"{1e6 * cpu / tokens:.1f} us of CPU per streamed token (pickle included), {chunks[0]} chunks "
              f"for {tokens} tokens")

    if opts.loop == "uvloop":
        import uvloop  # lazy: optional here

        uvloop.run(run())
    else:
        asyncio.run(run())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=0, help="default: the concurrency")
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--client-processes", type=int, default=0)
    p.add_argument("--loop", default="asyncio", help="uvicorn's --loop (asyncio, uvloop)")
    p.add_argument("--http", default="h11", help="uvicorn's --http (h11, httptools)")
    p.add_argument("--port", type=int, default=30777)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--in-process", action="store_true", help="no sockets and no client: see the docstring")
    opts = p.parse_args()
    if opts.in_process:
        in_process(opts)
        return
    if opts.serve:
        serve(opts, opts.port)
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve", *sys.argv[1:]])
    try:
        import httpx  # lazy: the driver side only

        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{opts.port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        before = _cpu_seconds(server.pid)
        with tempfile.NamedTemporaryFile(suffix=".jsonl") as out:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "dsctl", "bench", "serving", "--base-url",
                            f"http://127.0.0.1:{opts.port}", "--num-prompts", str(opts.num_prompts or opts.concurrency),
                            "--max-concurrency", str(opts.concurrency), "--random-input-len", str(opts.input_len),
                            "--random-output-len", str(opts.output_len), "--client-processes",
                            str(opts.client_processes), "--result-file", out.name],
                           check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            cpu = _cpu_seconds(server.pid) - before
            r = json.loads(open(out.name).read().splitlines()[-1])
        tokens = r["output_tokens"]
        itl, tpot = r["itl_ms"], r["tpot_ms"]
        print(f"loop={opts.loop} http={opts.http} conc={opts.concurrency} step={opts.step_ms} ms: "
              f"out tok/s {r['output_throughput']:.0f}, ITL p50 {itl['median']:.2f} p99 {itl['p99']:.2f} ms, "
              f"TPOT p50 {tpot['median']:.2f} ms, server CPU {cpu:.2f} s over {wall:.2f} s "
              f"({1e6 * cpu / max(1, tokens):.0f} us per token), client {r.get('client_processes')} processes "
              f"busiest {100 * (r.get('client_busy') or 0):.0f}%")
    finally:
        server.terminate()
        server.wait(10)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:  # a socket per stream
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    main()
