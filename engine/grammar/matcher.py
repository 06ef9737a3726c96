"""Per-request grammar state and the batch's token mask.

`RequestGrammar` wraps one request's xgrammar matcher. Its grammar may still be compiling (a Future from
`GrammarCompiler.submit`): the scheduler keeps the request out of its queue until `ready`, then calls `start`
(which raises the compile's GrammarError, failing that request only). With `after_reasoning` it starts only
once the output has closed the reasoning block (the `</think>` token ids; also when the prompt already ends
with them, as a chat template with thinking off does); before that the request's tokens are free.

`GrammarMasks` serves the scheduler's sampling step: `apply(logits, grammars)` fills the bitmask rows of
the constrained requests on the host (xgrammar's batch matcher, several threads; with CUDA this runs while
the device still computes the forward that produces `logits`), copies them to the logits' device and masks
the logits in place there (`apply_token_bitmask_inplace`). Rows without a grammar are not touched. Two host
buffers alternate, so filling one step's mask never overwrites the one the previous step may still copy.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Optional, Sequence, Union

import torch
import xgrammar as xgr

from engine.grammar.spec import GrammarSpec


class RequestGrammar:
    def __init__(self, compiled: Union[xgr.CompiledGrammar, Future], spec: GrammarSpec,
                 reasoning_end: tuple[int, ...], prompt_ids: Sequence[int]):
        self.spec = spec
        self.compiled = compiled if isinstance(compiled, Future) else None
        self.matcher = None if self.compiled is not None else xgr.GrammarMatcher(compiled)
        self.start_after = tuple(reasoning_end) if spec.after_reasoning else ()
        n = len(self.start_after)
        self.active = not n or tuple(prompt_ids[-n:]) == self.start_after
        self.tail: deque[int] = deque(maxlen=max(n, 1))

    @property
    def ready(self) -> bool:
        """Whether `start` returns at once (the grammar is compiled, or its compile failed)."""
        return self.matcher is not None or self.compiled.done()

    def start(self) -> None:
        """Make the matcher once the grammar is compiled (waits for it); raises the compile's GrammarError."""
        if self.matcher is None:
            self.matcher = xgr.GrammarMatcher(self.compiled.result())

    def accept(self, token: int) -> bool:
        """Take one generated token; False when the grammar does not allow it."""
        if not self.active:
            self.tail.append(token)
            self.active = tuple(self.tail) == self.start_after
            return True
        return self.matcher.accept_token(token)

    @property
    def constraining(self) -> bool:
        """Whether the next token is constrained (started and not yet at its end)."""
        return self.active and not self.matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        """The grammar's output is complete (its stop token accepted)."""
        return self.active and self.matcher.is_terminated()


class GrammarMasks:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.pin = device.type == "cuda"
        self.host: list[torch.Tensor] = []  # two alternating buffers, grown to the largest batch seen
        self.turn = 0
        self.batch = xgr.BatchGrammarMatcher()

    def _buffer(self, rows: int) -> torch.Tensor:
        if not self.host or self.host[0].shape[0] < rows:
            shape = xgr.get_bitmask_shape(max(rows, 2 * self.host[0].shape[0] if self.host else 8), self.vocab_size)
            self.host = [torch.empty(shape, dtype=xgr.bitmask_dtype, pin_memory=self.pin) for _ in range(2)]
        self.turn ^= 1
        return self.host[self.turn]

    def apply(self, logits: torch.Tensor, grammars: Sequence[Optional[RequestGrammar]]) -> None:
        """Mask row i of logits [N, >= vocab] with grammars[i] (None or not constraining: row left alone)."""
        rows = [i for i, g in enumerate(grammars) if g is not None and g.constraining]
        if not rows:
            return
        host = self._buffer(len(grammars))
        self.batch.batch_fill_next_token_bitmask([grammars[i].matcher for i in rows], host, indices=rows)
        mask = host[:len(grammars)].to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=rows)
