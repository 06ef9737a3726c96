"""OpenAI-compatible HTTP serving: a starlette app in the serving process, the model in an engine process.

    serving process                               engine process (spawned)
    ---------------                               ------------------------
    uvicorn + starlette routes (app.py)           EngineLoop (engine_process.py)
    pydantic request checks (schemas.py)            Engine -> Scheduler -> ModelRunner
    tokenizer / chat template (inputs.py)         drains AddRequest / AbortRequest,
    EngineClient (engine_client.py)  <--pipes-->  steps the scheduler while it has work,
    detokenizer, stop strings, reasoning          sends RequestOutput deltas + EngineStats
    metrics (metrics.py)

`serve(args)` (serve.py) runs it all; `dsctl serve` calls it.
"""
