"""An engine stand-in whose latency is its queue, for the router picking benchmarks.

`slots` requests run at once, each for `service_s`; the rest wait in FIFO order, so a request's
latency rises with the queue depth it finds. /metrics reports what a real engine reports
(tidal:num_requests_running, tidal:num_requests_waiting, tidal:kv_cache_usage_perc = the
running share of the slots). No model behind it.

Used in-process by benchmarks/router_picking.py, and as a process in place of `tidal-engine`
(`tidal dev up --engine-command "python benchmarks/queue_engine.py --slots 4 --service-ms 200"`)
by benchmarks/router_picking_dev.py: then it takes the engine's own arguments
(`serve MODEL --host H --port P --served-model-name N ...`) and ignores those it does not need.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import deque
from typing import Any

JSON = b"application/json"


class QueueEngine:
    """An ASGI app: the queue model, /metrics, /health and /v1/models."""

    def __init__(self, name: str, slots: int, service_s: float, served_name: str = "bench") -> None:
        self.name = name
        self.slots = slots
        self.service_s = service_s
        self.served_name = served_name
        self.running = 0
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.served = 0

    async def _run_one(self) -> None:
        if self.running >= self.slots:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.waiting.append(turn)
            await turn  # the slot is handed over by the request that finishes
        else:
            self.running += 1
        try:
            await asyncio.sleep(self.service_s)
        finally:
            self.served += 1
            if self.waiting:
                self.waiting.popleft().set_result(None)  # the slot passes on; running is unchanged
            else:
                self.running -= 1

    def _body(self, path: str) -> tuple[bytes, bytes] | None:
        if path == "/metrics":
            return (f"tidal:num_requests_running {self.running}\ntidal:num_requests_waiting {len(self.waiting)}\n"
                    f"tidal:kv_cache_usage_perc {self.running / self.slots}\n").encode(), b"text/plain"
        if path == "/health":
            return b"{}", JSON
        if path == "/v1/models":
            return json.dumps({"object": "list", "data": [{"id": self.served_name, "object": "model"}]}).encode(), JSON
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        fixed = self._body(scope["path"])
        if fixed is not None:
            body, content_type = fixed
        else:
            await self._run_one()
            body = json.dumps({"object": "chat.completion", "model": self.served_name, "replica": self.name,
                               "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}).encode()
            content_type = JSON
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4, help="requests run at once")
    parser.add_argument("--service-ms", type=float, default=200.0, help="time one request runs")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default="bench")
    args, _engine_args = parser.parse_known_args()  # `serve MODEL --dtype ...`: not needed here
    engine = QueueEngine(f"{args.host}:{args.port}", args.slots, args.service_ms / 1000, args.served_model_name)
    uvicorn.run(engine, host=args.host, port=args.port, log_level="warning", access_log=False,
                backlog=1024, lifespan="off")


if __name__ == "__main__":
    main()
