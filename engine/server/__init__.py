"""OpenAI-compatible HTTP serving: a starlette app in the serving process, the model in the engine ranks.

    serving process                               engine rank processes (engine/runtime/)
    ---------------                               ---------------------------------------
    uvicorn + starlette routes (app.py;           EngineLoop (rank_loop.py)
      endpoint.py: the skeleton the completion      Engine -> Scheduler -> ModelRunner
      and chat routes share)                      drains AddRequest / AbortRequest,
    API key (auth.py), body / JSON limits         steps the scheduler while it has work,
      (limits.py), pydantic checks (schemas.py)   sends the output processor's
    tokenizer / chat template (inputs.py), in a
      worker thread
    runtime's EngineClient (client.py) <-pipes->  RequestOutput deltas + EngineStats
    Sequence: deltas -> text (generation.py),
    reasoning split, metrics (metrics.py)
    tools (tool_calls.py: template, forcing
      grammar; tool_parser.py: calls read back),
    structured outputs (structured.py): grammar
      specs checked here, masks in the engine

Prompts are checked with the engine's own check (engine/scheduler/prompt_check.py);
the deltas are the ones the offline Engine collects (engine/scheduler/output.py).
`serve(args)` (serve.py) runs it all; `dsctl serve` calls it.
"""
