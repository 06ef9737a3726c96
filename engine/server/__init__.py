"""OpenAI-compatible HTTP serving: a starlette app in the serving process, the model in the engine ranks.

    serving process                               engine rank processes (engine/runtime/)
    ---------------                               ---------------------------------------
    uvicorn + starlette routes (app.py;           EngineLoop (rank_loop.py)
      endpoint.py: the skeleton the completion      Engine -> Scheduler -> ModelRunner
      and chat routes share)                      drains AddRequest / AbortRequest,
    pydantic request checks (schemas.py)          steps the scheduler while it has work,
    tokenizer / chat template (inputs.py)         sends the output processor's
    runtime's EngineClient (client.py) <-pipes->  RequestOutput deltas + EngineStats
    Sequence: deltas -> text (generation.py),
    reasoning split, metrics (metrics.py)

Prompts are checked with the engine's own check (engine/scheduler/prompt_check.py);
the deltas are the ones the offline Engine collects (engine/scheduler/output.py).
`serve(args)` (serve.py) runs it all; `dsctl serve` calls it.
"""
