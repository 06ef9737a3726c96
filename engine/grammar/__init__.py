"""Grammar-constrained decoding (xgrammar): what a request's output must match, compiled for the model's
vocabulary, and the per-step token masks applied to the logits before sampling.

spec.py       `GrammarSpec`, the plain picklable description that travels with a request
compiler.py   specs -> xgrammar grammars: `check` (no tokenizer: the server's 400s), `GrammarCompiler`
              (the engine's vocabulary, compiled grammars cached)
tool_calls.py the DeepSeek tool-call block as a grammar (`tool_choice` required or a named function)
matcher.py    `RequestGrammar` (one request's matcher, started after the reasoning block when asked) and
              `GrammarMasks` (the batch's bitmask filled on the host, applied to the logits on the device)
"""
