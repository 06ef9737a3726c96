"""ServerState: what every route needs (server flags, limits, engine client, tokenizer, metrics, model names)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional

from engine.args import ServerArgs
from engine.runtime.client import EngineClient
from engine.runtime.protocol import EngineInfo
from engine.server.errors import APIError, unavailable
from engine.server.limits import Limits
from engine.server.metrics import ServerMetrics


@dataclass
class ServerState:
    args: ServerArgs
    client: EngineClient
    tokenizer: object  # engine.checkpoint.tokenizer.Tokenizer or None
    metrics: ServerMetrics
    model_name: str  # what /v1/models reports and requests must name (--served-model-name, else --model)
    model_root: str  # --model as given (the card's "root")
    created: int = field(default_factory=lambda: int(time.time()))
    exit_code: int = 0
    request_exit: Optional[callable] = None  # set by serve(): ask uvicorn to stop
    api_key: Optional[str] = None  # --api-key or $DSCTL_API_KEY
    draining: bool = False  # a shutdown has begun: new requests get 503
    forced: bool = False  # a second signal: stop the engine without waiting
    limits: Limits = field(default_factory=Limits)

    def check_accepting(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down", 5)

    def info(self) -> EngineInfo:
        """The engine's limits, or a 503 while it is loading or after it died."""
        if not self.client.healthy:
            if self.client.dead_reason is not None:
                raise unavailable("the engine process is not running; the server must be restarted", 30)
            raise unavailable("the engine is still loading the model", 5)
        return self.client.info

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           "not_found_error", "model", "model_not_found")


async def until_disconnect(request, awaitable) -> bool:
    """Run awaitable; if the client disconnects first, cancel it. True when it completed."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()  # the server is giving up on this request (shutdown timeout)
        raise
    finally:
        watcher.cancel()
    if task.done():
        task.result()  # re-raise its error
        return True
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone anyway
        pass
    return False


async def _disconnected(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
