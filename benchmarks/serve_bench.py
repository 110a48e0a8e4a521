"""Served-load benchmark: an async load generator against any OpenAI-compatible server
(Tidal's ``tidal-engine serve``, vLLM, SGLang, ...).

Usage (the server already running):

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 \
        --input-len 256 --output-len 128 --num-prompts 512 --max-concurrency 256 --out serve.json
    ... --temperature 0.8 --top-p 0.95 --top-k 50            (sampled instead of greedy)
    ... --sweep 1,16,64,256                                   (one run per concurrency)

The workload:
  * prompts are random token ids (seeded, drawn uniformly from [100, vocab_size - 100)),
    sent as ``"prompt": [ids...]`` to ``/v1/completions``, so no tokenizer is involved and the
    server sees exactly ``--input-len`` prompt tokens. Each run draws fresh prompts (the seed is
    combined with the run's index and concurrency), so runs don't hit each other's prefix cache;
    give a different ``--seed`` to each invocation against one server for the same reason;
  * every request streams (``stream: true``, ``stream_options.include_usage``), ignores EOS and
    asks for ``max_tokens = --output-len``, so output lengths are exact;
  * at most ``--max-concurrency`` requests are in flight; all are queued at once (no arrival
    rate): the "closed loop" of vLLM's ``benchmark_serving --max-concurrency``;
  * a few warm-up requests (``--num-warmup``) run first and are not counted.

What is measured, per request (times from just before the request is sent):
  TTFT   the arrival of the first chunk that carries content (non-empty text or token ids);
  e2e    the end of the stream (``data: [DONE]`` or the connection closing);
  tokens ``usage.completion_tokens`` of the final usage chunk; when a server sends no usage,
         the number of content chunks (a lower bound: flagged by ``usage_missing``);
  TPOT   (e2e - TTFT) / (tokens - 1), token-exact since the token count comes from usage;
  ITL    the gaps between consecutive content chunks. A server may put several tokens in one
         chunk (a detokenizer holding back an incomplete character, a step that emits more
         than one token): ITL is then per chunk, not per token, as in vLLM's benchmark_serving.
         ``tokens_per_chunk`` (tokens / content chunks) shows how often that happens; with 1.0,
         ITL is per token.
Per run: duration (first send to last finish), request/s, output tok/s, total tok/s,
failures (counted by error message; a failed request never stops the run: every request has a
wall-clock limit, ``--request-timeout``), mean/p50/p90/p99/max of TTFT, TPOT, ITL and e2e
(percentiles by linear interpolation, numpy's default), and the client's own CPU use: a
client_cpu_util near 1.0 means the load generator, not the server, may be the bottleneck.

Output: a table on stdout; ``--out`` writes JSON with the exact command line, the UTC date,
the server URL, every parameter (the API key masked) and each run's results.
HTTP client: aiohttp when installed (lighter per chunk), else httpx (``--client``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

TOKEN_ID_MARGIN = 100  # ids are drawn from [margin, vocab_size - margin): clear of specials at both ends


# ------------------------------------------------------------------ workload

def make_prompts(num: int, input_len: int, vocab_size: int, seed: str | int) -> list[list[int]]:
    """``num`` prompts of ``input_len`` random token ids, the same for the same seed."""
    low, high = TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN
    if high <= low:
        raise ValueError(f"--vocab-size {vocab_size} leaves no ids between {low} and {high}")
    rng = random.Random(str(seed))
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(num)]


def sweep_num_prompts(concurrency: int, factor: float, minimum: int, maximum: int | None) -> int:
    n = max(int(math.ceil(factor * concurrency)), minimum)
    return min(n, maximum) if maximum else n


def build_payload(model: str, prompt: list[int], max_tokens: int, temperature: float,
                  top_p: float | None, top_k: int | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    if top_p is not None:
        payload["top_p"] = top_p
    if top_k is not None:
        payload["top_k"] = top_k
    payload.update(extra or {})
    return payload


# ------------------------------------------------------------------ one request's record

@dataclass
class RequestResult:
    prompt_len: int = 0
    ok: bool = False
    error: str | None = None
    output_tokens: int = 0  # usage.completion_tokens, else the number of content chunks
    usage_reported: bool = False
    ttft: float | None = None  # seconds
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # content chunks, seconds since the send
    finish_reason: str | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_times)


def parse_sse_line(line: str | bytes) -> Any:
    """One line of an SSE stream: the decoded JSON of a ``data:`` line, the string "[DONE]",
    or None for anything else (blank lines, comments, other fields)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "[DONE]"
    if not data:
        return None
    return json.loads(data)


def chunk_has_content(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if choice.get("text") or choice.get("token_ids") or (choice.get("delta") or {}).get("content"):
            return True
    return False


def feed_event(result: RequestResult, event: Any, t: float) -> bool:
    """Apply one parsed SSE event, seen ``t`` seconds after the send; True at the end of the stream."""
    if event == "[DONE]":
        return True
    if not isinstance(event, dict):
        return False
    if "error" in event and not event.get("choices"):
        err = event["error"]
        result.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return True
    if chunk_has_content(event):
        if result.ttft is None:
            result.ttft = t
        result.chunk_times.append(t)
    for choice in event.get("choices") or ():
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.usage_reported = True
    return False


def finish(result: RequestResult, e2e: float) -> RequestResult:
    """Close a request's record once its stream ended at ``e2e`` seconds."""
    result.e2e = e2e
    if not result.usage_reported:
        result.output_tokens = result.num_chunks
    if result.error is None and result.ttft is None:
        result.error = "stream ended without content"
    result.ok = result.error is None
    return result


# ------------------------------------------------------------------ statistics

def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def itls(chunk_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive content chunks of one request."""
    return [b - a for a, b in zip(chunk_times, chunk_times[1:])]


def tpot(ttft: float | None, e2e: float | None, output_tokens: int) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (tokens - 1); None for <2 tokens."""
    if ttft is None or e2e is None or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


PERCENTILES = (50, 90, 99)


def describe_ms(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50/p90/p99 and max of values in seconds, as milliseconds."""
    out: dict[str, float | None] = {"n": len(values)}
    out["mean"] = sum(values) / len(values) * 1e3 if values else None
    for q in PERCENTILES:
        p = percentile(values, q)
        out[f"p{q}"] = None if p is None else p * 1e3
    out["max"] = max(values) * 1e3 if values else None
    return out


def summarize(results: Sequence[RequestResult], duration: float, expected_output_len: int | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    errors: dict[str, int] = {}
    for r in failed:
        key = (r.error or "unknown")[:300]
        errors[key] = errors.get(key, 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    chunks = sum(r.num_chunks for r in ok)
    tpots = [x for r in ok if (x := tpot(r.ttft, r.e2e, r.output_tokens)) is not None]
    all_itls = [g for r in ok for g in itls(r.chunk_times)]
    return {
        "requests": len(results), "completed": len(ok), "failed": len(failed),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])),
        "duration_s": duration,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else None,
        "content_chunks": chunks,
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
        "usage_missing": sum(1 for r in ok if not r.usage_reported),
        "wrong_output_len": (sum(1 for r in ok if r.output_tokens != expected_output_len)
                             if expected_output_len is not None else None),
        "ttft_ms": describe_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": describe_ms(tpots),
        "itl_ms": describe_ms(all_itls),
        "e2e_ms": describe_ms([r.e2e for r in ok if r.e2e is not None]),
    }


# ------------------------------------------------------------------ HTTP clients

class HttpError(Exception):
    pass


class AiohttpClient:
    name = "aiohttp"

    def __init__(self, connections: int, connect_timeout: float, read_timeout: float) -> None:
        import aiohttp

        self.version = aiohttp.__version__
        self._aiohttp = aiohttp
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections, limit_per_host=connections, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=read_timeout),
            read_bufsize=1 << 18,
        )

    async def stream_lines(self, url: str, payload: dict[str, Any], headers: dict[str, str]) -> AsyncIterator[bytes]:
        async with self.session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.read())[:500].decode("utf-8", errors="replace")
                raise HttpError(f"HTTP {resp.status}: {body}")
            async for line in resp.content:
                yield line

    async def get_json(self, url: str, headers: dict[str, str]) -> Any:
        async with self.session.get(url, headers=headers) as resp:
            if resp.status != 200:
                raise HttpError(f"HTTP {resp.status}: {(await resp.text())[:500]}")
            return await resp.json()

    async def close(self) -> None:
        await self.session.close()


class HttpxClient:
    name = "httpx"

    def __init__(self, connections: int, connect_timeout: float, read_timeout: float) -> None:
        import httpx

        self.version = httpx.__version__
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            timeout=httpx.Timeout(connect=connect_timeout, read=read_timeout, write=connect_timeout, pool=None),
        )

    async def stream_lines(self, url: str, payload: dict[str, Any], headers: dict[str, str]) -> AsyncIterator[str]:
        async with self.client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread())[:500].decode("utf-8", errors="replace")
                raise HttpError(f"HTTP {resp.status_code}: {body}")
            async for line in resp.aiter_lines():
                yield line

    async def get_json(self, url: str, headers: dict[str, str]) -> Any:
        resp = await self.client.get(url, headers=headers)
        if resp.status_code != 200:
            raise HttpError(f"HTTP {resp.status_code}: {resp.text[:500]}")
        return resp.json()

    async def close(self) -> None:
        await self.client.aclose()


def make_client(kind: str, connections: int, connect_timeout: float, read_timeout: float) -> Any:
    if kind == "auto":
        try:
            import aiohttp  # noqa: F401

            kind = "aiohttp"
        except ImportError:
            kind = "httpx"
    cls = AiohttpClient if kind == "aiohttp" else HttpxClient
    return cls(connections, connect_timeout, read_timeout)


# ------------------------------------------------------------------ load

@dataclass
class Target:
    base_url: str
    model: str
    headers: dict[str, str]
    endpoint: str = "/v1/completions"

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


async def send_one(client: Any, target: Target, payload: dict[str, Any], timeout: float,
                   clock: Callable[[], float] = time.perf_counter) -> RequestResult:
    """One streamed request; never raises: errors and timeouts end up in the result."""
    result = RequestResult(prompt_len=len(payload["prompt"]) if isinstance(payload.get("prompt"), list) else 0)
    start = clock()

    async def consume() -> None:
        async for line in client.stream_lines(target.url, payload, target.headers):
            event = parse_sse_line(line)
            if event is None:
                continue
            if feed_event(result, event, clock() - start):
                break

    try:
        await asyncio.wait_for(consume(), timeout)
    except asyncio.TimeoutError:
        result.error = f"timeout after {timeout:g} s"
    except Exception as exc:  # connection refused/reset, bad JSON, HTTP errors: counted, never raised
        result.error = f"{type(exc).__name__}: {exc}"[:500] if str(exc) else type(exc).__name__
    return finish(result, clock() - start)


async def run_load(client: Any, target: Target, payloads: Sequence[dict[str, Any]], concurrency: int,
                   timeout: float) -> tuple[list[RequestResult], dict[str, Any]]:
    """All payloads, at most ``concurrency`` in flight; returns the results in payload order."""
    sem = asyncio.Semaphore(concurrency)
    in_flight = 0
    peak = 0

    async def one(payload: dict[str, Any]) -> RequestResult:
        nonlocal in_flight, peak
        async with sem:
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send_one(client, target, payload, timeout)
            finally:
                in_flight -= 1

    cpu0, t0 = time.process_time(), time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in payloads))
    duration = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return list(results), {"duration_s": duration, "max_in_flight": peak, "client_cpu_s": cpu,
                           "client_cpu_util": cpu / duration if duration > 0 else None}


async def discover_model(client: Any, base_url: str, headers: dict[str, str]) -> str:
    body = await client.get_json(base_url.rstrip("/") + "/v1/models", headers)
    return body["data"][0]["id"]


# ------------------------------------------------------------------ report

def fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


TABLE_COLUMNS = [
    ("conc", lambda r: r["concurrency"]), ("reqs", lambda r: r["requests"]), ("fail", lambda r: r["failed"]),
    ("dur s", lambda r: fmt(r["duration_s"], 2)), ("req/s", lambda r: fmt(r["request_throughput"], 2)),
    ("out tok/s", lambda r: fmt(r["output_throughput"], 0)),
    ("TTFT p50/p90/p99 ms", lambda r: "/".join(fmt(r["ttft_ms"][f"p{q}"]) for q in PERCENTILES)),
    ("TPOT p50/p90/p99 ms", lambda r: "/".join(fmt(r["tpot_ms"][f"p{q}"], 2) for q in PERCENTILES)),
    ("ITL p50/p90/p99 ms", lambda r: "/".join(fmt(r["itl_ms"][f"p{q}"], 2) for q in PERCENTILES)),
    ("tok/chunk", lambda r: fmt(r["tokens_per_chunk"], 2)), ("cli cpu", lambda r: fmt(r.get("client_cpu_util"), 2)),
]


def format_table(runs: Sequence[dict[str, Any]]) -> str:
    rows = [[str(fn(r)) for _, fn in TABLE_COLUMNS] for r in runs]
    heads = [h for h, _ in TABLE_COLUMNS]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------ main

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    ap.add_argument("--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY, $TIDAL_API_KEY)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--max-concurrency", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=32000,
                    help="prompt ids are drawn from [100, vocab_size-100); 32000 suits any current model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    ap.add_argument("--sweep", default=None,
                    help="comma-separated concurrencies, e.g. 1,16,64,256: one run each "
                         "(instead of --num-prompts/--max-concurrency)")
    ap.add_argument("--sweep-prompts-factor", type=float, default=2.0, help="prompts per run = factor x concurrency ...")
    ap.add_argument("--sweep-min-prompts", type=int, default=16, help="... but at least this many")
    ap.add_argument("--sweep-max-prompts", type=int, default=None, help="... and at most this many")
    ap.add_argument("--num-warmup", type=int, default=4, help="warm-up requests before the first run (not counted)")
    ap.add_argument("--warmup-output-len", type=int, default=16)
    ap.add_argument("--request-timeout", type=float, default=600.0, help="wall-clock limit of one request, seconds")
    ap.add_argument("--connect-timeout", type=float, default=30.0)
    ap.add_argument("--read-timeout", type=float, default=120.0, help="longest silence inside one stream, seconds")
    ap.add_argument("--client", choices=["auto", "aiohttp", "httpx"], default="auto")
    ap.add_argument("--no-uvloop", action="store_true", help="the default asyncio loop even where uvloop is installed")
    ap.add_argument("--label", default=None, help="a free-form name stored in the JSON")
    ap.add_argument("--save-requests", action="store_true", help="store every request's record in the JSON")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    prog = sys.argv[0] if argv is None else "benchmarks/serve_bench.py"
    words = list(sys.argv[1:] if argv is None else argv)
    for i, w in enumerate(words):  # never store the key
        if w.startswith("--api-key="):
            words[i] = "--api-key=***"
        elif w == "--api-key" and i + 1 < len(words):
            words[i + 1] = "***"
    args.command = shlex.join([os.path.basename(sys.executable), prog, *words])
    if args.extra_body:
        args.extra_body = json.loads(args.extra_body)
        if not isinstance(args.extra_body, dict):
            ap.error("--extra-body must be a JSON object")
    return args


def run_plan(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(concurrency, num_prompts) of each run."""
    if args.sweep:
        concs = [int(c) for c in str(args.sweep).split(",") if c.strip()]
        return [(c, sweep_num_prompts(c, args.sweep_prompts_factor, args.sweep_min_prompts, args.sweep_max_prompts))
                for c in concs]
    return [(args.max_concurrency, args.num_prompts)]


def public_params(args: argparse.Namespace) -> dict[str, Any]:
    params = {k: v for k, v in vars(args).items() if k != "command"}
    if params.get("api_key"):
        params["api_key"] = "***"
    return params


async def bench(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    plan = run_plan(args)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("TIDAL_API_KEY")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    connections = max(c for c, _ in plan) + 4
    client = make_client(args.client, connections, args.connect_timeout, args.read_timeout)
    report: dict[str, Any] = {
        "benchmark": "serve_bench",
        "command": args.command,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "base_url": args.base_url, "endpoint": args.endpoint, "label": args.label,
        "client": f"{client.name} {client.version}", "event_loop": type(asyncio.get_running_loop()).__module__,
        "python": platform.python_version(), "host": platform.node(),
        "parameters": public_params(args),
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k},
        "runs": [],
    }
    try:
        model = args.model or await discover_model(client, args.base_url, headers)
        report["model"] = model
        target = Target(args.base_url, model, headers, args.endpoint)

        def payloads(prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
            return [build_payload(model, p, max_tokens, args.temperature, args.top_p, args.top_k, args.extra_body)
                    for p in prompts]

        if args.num_warmup > 0:
            log(f"warm-up: {args.num_warmup} requests of {args.input_len} -> {args.warmup_output_len} tokens")
            prompts = make_prompts(args.num_warmup, args.input_len, args.vocab_size, f"{args.seed}:warmup")
            results, info = await run_load(client, target, payloads(prompts, args.warmup_output_len),
                                           args.num_warmup, args.request_timeout)
            report["warmup"] = {**summarize(results, info["duration_s"]), **info}
            if not any(r.ok for r in results):
                raise RuntimeError(f"every warm-up request failed: {report['warmup']['errors']}")
        for index, (conc, num) in enumerate(plan):
            log(f"run {index + 1}/{len(plan)}: {num} prompts of {args.input_len} -> {args.output_len} tokens, "
                f"concurrency {conc}, temperature {args.temperature}")
            prompts = make_prompts(num, args.input_len, args.vocab_size, f"{args.seed}:{index}:{conc}")
            results, info = await run_load(client, target, payloads(prompts, args.output_len), conc,
                                           args.request_timeout)
            run = {"concurrency": conc, "num_prompts": num, "input_len": args.input_len,
                   "output_len": args.output_len, **summarize(results, info["duration_s"], args.output_len), **info}
            if args.save_requests:
                run["per_request"] = [asdict(r) for r in results]
            report["runs"].append(run)
            log(f"  {run['completed']}/{num} ok in {run['duration_s']:.2f} s, "
                f"{fmt(run['output_throughput'], 0)} out tok/s" + (f", errors: {run['errors']}" if run["failed"] else ""))
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        await client.close()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    runner: Callable[[Any], Any] = asyncio.run
    if not args.no_uvloop:
        try:
            import uvloop  # type: ignore[import-not-found]

            runner = uvloop.run
        except (ImportError, AttributeError):
            pass
    report = runner(bench(args, log=lambda s: print(s, flush=True)))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print()
    print(f"{report.get('model', '?')} at {args.base_url}: {args.input_len} -> {args.output_len} tokens, "
          f"temperature {args.temperature}" + (f", top_p {args.top_p}" if args.top_p is not None else "")
          + (f", top_k {args.top_k}" if args.top_k is not None else ""))
    if report["runs"]:
        print(format_table(report["runs"]))
    if args.out:
        print(f"results: {args.out}")
    if "error" in report:
        print(f"ERROR: {report['error']}", file=sys.stderr)
        return 2
    return 1 if any(r["failed"] for r in report["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
