"""Requests whose grammar is still compiling (on `GrammarCompiler`'s background thread), held out of the
scheduler's queue: `ready()` hands back those whose compile has finished, each with the error that fails it
(the compile's GrammarError) or None. When the scheduler has nothing else to run it may `wait` a little for
one, instead of spinning its step loop.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait
from typing import Optional

from engine.grammar.spec import GrammarError

IDLE_WAIT_S = 0.005  # the longest an idle scheduler waits for a compile per step (messages are read between)


class PendingGrammars:
    def __init__(self):
        self.requests: list = []  # scheduler Requests whose `grammar` (a RequestGrammar) is not ready yet

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, req) -> None:
        self.requests.append(req)

    def remove(self, which) -> list:
        """Take out (and return) the requests `which(req)` is true of (aborts)."""
        gone = [r for r in self.requests if which(r)]
        self.requests = [r for r in self.requests if not which(r)]
        return gone

    def wait(self, timeout: float = IDLE_WAIT_S) -> None:
        """Block until one compile finishes, or timeout seconds."""
        wait([r.grammar.compiled for r in self.requests], timeout=timeout, return_when=FIRST_COMPLETED)

    def ready(self) -> list[tuple[object, Optional[str]]]:
        """(request, error or None) for each request whose compile finished; its matcher is started."""
        out, still = [], []
        for req in self.requests:
            if not req.grammar.ready:
                still.append(req)
                continue
            try:
                req.grammar.start()
                out.append((req, None))
            except GrammarError as exc:
                out.append((req, str(exc)))
            except Exception as exc:  # noqa: BLE001 - an unexpected compile failure fails that request only
                out.append((req, f"the grammar cannot be compiled: {type(exc).__name__}: {exc}"))
        self.requests = still
        return out
