"""Greedy reference outputs of the offline Engine, computed in a clean subprocess.

Run as `python -m tests.server.offline_ref` with a JSON list of jobs on stdin;
prints a JSON list of results (one list of outputs per job). A job is
{"prompts": [...]} or {"input_ids": [[...]]} or {"messages": [...]} (rendered
with the chat template), with "max_tokens" and optional "prompt_logprobs" and "ignore_eos".

It runs outside pytest because tests/conftest.py sets TRITON_INTERPRET=1 for
the kernel tests, and the offline Engine is many times slower in a process that
has it; `dsctl serve` does not run under it either.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _run(jobs: list[dict]) -> list[list[dict]]:
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    engine = Engine(model="tiny", device="cpu", dtype="float32")  # the dtype `dsctl serve` uses on CPU
    results = []
    for job in jobs:
        params = SamplingParams(temperature=0, max_new_tokens=job["max_tokens"],
                                prompt_logprobs=bool(job.get("prompt_logprobs")),
                                ignore_eos=bool(job.get("ignore_eos")))
        if "messages" in job:
            outs = engine.generate(input_ids=[engine.tokenizer.apply_chat_template(job["messages"])],
                                   sampling_params=params)
        elif "input_ids" in job:
            outs = engine.generate(input_ids=job["input_ids"], sampling_params=params)
        else:
            outs = engine.generate(prompts=job["prompts"], sampling_params=params)
        results.append([{
            "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
            "prompt_token_ids": o.prompt_token_ids, "prompt_logprobs": o.prompt_logprobs,
            "prompt_text": engine.tokenizer.decode(o.prompt_token_ids, False),
        } for o in outs])
    return results


def reference(jobs: list[dict]) -> list[list[dict]]:
    """Run the jobs in a subprocess without TRITON_INTERPRET; return its results."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "tests.server.offline_ref"], input=json.dumps(jobs), cwd=root,
                         capture_output=True, text=True, env=env, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"offline reference failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(_run(json.loads(sys.stdin.read()))))
