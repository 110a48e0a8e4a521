"""`tidal-engine`: `serve` runs the OpenAI-compatible server, `generate` runs one prompt offline.

Flags carry vLLM's names. A vLLM flag Tidal does not have is unknown to the parser, and
combinations Tidal cannot honour are refused (`check_unsupported`), so a vLLM command line that
relies on them fails loudly instead of silently serving something else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from tidal_engine import __version__

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def _parse(text: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = int(_parse(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"port must be <= 65535, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(_parse(text, float))
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(_parse(text, float))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _bytes(text: str) -> int:
    """An integer byte count, optionally with a K/M/G/Ki/Mi/Gi suffix (vLLM accepts '4G')."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
    lowered = text.strip().lower().removesuffix("b")
    for suffix in sorted(units, key=len, reverse=True):
        if lowered.endswith(suffix):
            try:
                value = int(float(lowered[: -len(suffix)]) * units[suffix])
            except ValueError:
                break
            return _positive_int(str(value))
    return _positive_int(lowered)


def _lora_module(text: str) -> tuple[str, str]:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
            name, path = entry["name"], entry["path"]
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f"expected {{\"name\": ..., \"path\": ...}}, got {text!r}") from None
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty name and path, got {text!r}")
    return name.strip(), path.strip()


DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32")


def _speculative_config(text: str) -> dict:
    from tidal_engine.spec_decode.config import SpeculativeConfig

    try:
        SpeculativeConfig.parse(text)  # checked here so a bad value is a usage error
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return json.loads(text)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by `serve` and `generate` (EngineConfig's fields)."""
    model = parser.add_argument_group("model")
    model.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    model.add_argument("--dtype", default="auto", choices=DTYPES, help="weight and activation dtype")
    model.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    model.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    model.add_argument("--max-model-len", type=_positive_int, default=None,
                       help="context length (default: the model's)")
    model.add_argument("--quantization", "-q", default=None,
                       choices=("none", "fp8", "awq", "gptq", "compressed-tensors"),
                       help="weight format (default: the checkpoint's); fp8 also quantizes a 16/32-bit checkpoint "
                            "while loading (docs/quantization.md)")
    model.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    model.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                       help="auto: read the checkpoint; dummy: random weights of its shape (benchmarks)")
    model.add_argument("--cache-dir", default=None,
                       help="start-up cache: Triton's compiled kernels and the one-row-linear choices "
                            "(default: $TIDAL_CACHE_DIR or ~/.cache/tidal)")
    model.add_argument("--runner", default="auto", choices=("auto", "generate", "pooling"),
                       help="generate text, or pool (embeddings, scores, rerank); auto: pooling for encoder "
                            "and sequence-classification checkpoints (docs/embeddings.md)")
    model.add_argument("--convert", default="auto", choices=("auto", "embed", "classify"),
                       help="what a pooling model computes (default: from the checkpoint)")
    model.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM command lines; Tidal runs only its built-in architectures")

    sched = parser.add_argument_group("scheduler and KV cache")
    sched.add_argument("--max-num-seqs", type=_positive_int, default=256, help="most requests in one batch")
    sched.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                       help="token budget of one step")
    sched.add_argument("--block-size", type=int, default=16, choices=(1, 2, 4, 8, 16, 32, 64, 128),
                       help="tokens per KV block")
    sched.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                       help="fraction of device memory the engine may use")
    sched.add_argument("--kv-cache-memory-bytes", type=_bytes, default=None,
                       help="explicit KV-cache budget, e.g. 2G (overrides --gpu-memory-utilization)")
    sched.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"),
                       help="KV-cache storage: the model dtype (auto) or float8 e4m3 with per-layer scales "
                            "from the checkpoint (1.0 otherwise): twice the blocks (docs/quantization.md)")
    sched.add_argument("--num-gpu-blocks-override", type=_positive_int, default=None,
                       help="exact number of KV blocks")
    sched.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse KV blocks of shared prompt prefixes")
    sched.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="split long prompts across steps")
    sched.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule the next step while the device runs this one (default: on with CUDA)")
    sched.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"),
                       help="admit and preempt by arrival (fcfs) or by each request's priority, lower first")
    sched.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                       help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_max": 3} or a draft model sharing the tokenizer: {"model": '
                            '"PATH_OR_ALIAS", "num_speculative_tokens": 4} (docs/speculative-decoding.md)')
    sched.add_argument("--enable-sleep-mode", action="store_true",
                       help="allow /sleep and /wake_up (free device memory on demand)")
    sched.add_argument("--kv-offloading-size", type=float, default=None,
                       help="GiB of host memory (pinned on CUDA) that keeps KV blocks evicted from the device "
                            "cache, served back on a prefix hit (docs/kv-offload.md); default: off")
    sched.add_argument("--kv-offloading-backend", default="native", choices=("native",),
                       help="the KV offload implementation (vLLM's flag; only Tidal's own)")
    sched.add_argument("--kv-offloading-save", default="write-through", choices=("write-through", "eviction"),
                       help="save full blocks to host memory once computed (write-through) or when the device "
                            "cache evicts them (eviction); docs/kv-offload.md compares them")

    lora = parser.add_argument_group("LoRA", "multi-LoRA serving (docs/lora.md)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters next to the base model")
    lora.add_argument("--max-loras", type=_positive_int, default=None,
                      help="adapters usable in one batch: device slots (default 1)")
    lora.add_argument("--max-lora-rank", type=_positive_int, default=None, help="largest adapter rank (default 16)")
    lora.add_argument("--max-cpu-loras", type=_positive_int, default=None,
                      help="adapters kept in host memory (default: --max-loras)")
    lora.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                      help="adapters to load at start (name=path or JSON {\"name\", \"path\"})")
    lora.add_argument("--allowed-lora-roots", nargs="+", default=None, metavar="DIR",
                      help="folders adapters may be loaded from; without it /v1/load_lora_adapter is refused")

    parallel = parser.add_argument_group("parallelism", "one model over several devices (docs/parallelism.md)")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                          help="split every layer over this many devices (gloo ranks on CPU)")
    parallel.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int, default=1,
                          help="split the layers into this many stages, one device (set) each")
    parallel.add_argument("--distributed-executor-backend", default=None, choices=("uni", "mp"),
                          help="workers in the engine-core process (uni, the default for one device) "
                               "or one process per rank (mp, the default for more)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal-engine", description="Tidal's vLLM-compatible inference engine.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate}")

    serve = commands.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible HTTP server (vLLM's flag names).",
    )
    serve.set_defaults(subparser=serve)  # errors then print this command's usage
    serve.add_argument("model", help="HF folder, .gguf file, or an alias such as smollm2-135m")
    http = serve.add_argument_group("HTTP server")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    http.add_argument("--port", type=_port, default=8000)
    http.add_argument("--served-model-name", nargs="+", default=None,
                      help="name(s) clients use in `model` (default: the model argument)")
    http.add_argument("--max-request-body-bytes", type=_bytes, default=DEFAULT_MAX_BODY_BYTES,
                      help="larger bodies get 413")
    http.add_argument("--api-server-count", type=_positive_int, default=1,
                      help="API server processes sharing the port (HTTP, tokenizing, detokenizing); "
                           "the engine core runs in its own process")
    http.add_argument("--shutdown-timeout", type=_non_negative_float, default=30.0,
                      help="seconds SIGTERM waits for in-flight requests before aborting them")
    security = serve.add_argument_group("security")
    security.add_argument("--api-key", default=None,
                          help="require 'Authorization: Bearer KEY' on every path but /health and /ping "
                               "(default: $TIDAL_API_KEY)")
    security.add_argument("--allowed-origins", nargs="*", default=[],
                          help="CORS origins to allow (default: none)")
    security.add_argument("--no-protect-metrics", dest="protect_metrics", action="store_false",
                          help="serve /metrics without the API key")
    chat = serve.add_argument_group("chat output", "tool calls, reasoning, templates (docs/engine-api.md)")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    chat.add_argument("--tool-call-parser", default=None, choices=tool_parser_names(),
                      help="how tool calls look in this model's output")
    chat.add_argument("--reasoning-parser", default=None, choices=reasoning_parser_names(),
                      help="split <think>…</think> into reasoning_content")
    chat.add_argument("--chat-template", default=None,
                      help="a Jinja chat template (file or inline) replacing the tokenizer's")
    chat.add_argument("--generation-config", default="auto", metavar="auto|vllm|PATH",
                      help="sampling defaults: the model's generation_config.json (auto), none (vllm), "
                           "or the one in PATH")
    http.add_argument("--metrics-prefix", default="tidal", choices=("tidal", "vllm"),
                      help="name /metrics families tidal:… or vllm:… (vLLM dashboards, KEDA, the Gateway API "
                           "Inference Extension read vllm:… unchanged)")
    logs = serve.add_argument_group("logging")
    logs.add_argument("--disable-log-requests", action="store_true", help="no per-request log line")
    logs.add_argument("--log-prompts", action="store_true", help="include prompts in the request log line")
    _add_engine_args(serve)

    generate = commands.add_parser(
        "generate", help="generate once, offline, with tidal_engine.LLM",
        description="Load the model, generate for one prompt or chat message, print the text.",
    )
    generate.set_defaults(subparser=generate)
    generate.add_argument("--model", required=True, help="HF folder, .gguf file, or alias")
    what = generate.add_argument_group("input (one of)").add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="raw text prompt")
    what.add_argument("--chat", help="a user message, rendered with the chat template")
    sampling = generate.add_argument_group("sampling")
    sampling.add_argument("--system", default=None, help="system message for --chat")
    sampling.add_argument("--max-tokens", type=_positive_int, default=64)
    sampling.add_argument("--temperature", type=_non_negative_float, default=0.0)
    sampling.add_argument("--top-p", type=_fraction, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--n", type=_positive_int, default=1)
    _add_engine_args(generate)
    return parser


def tool_parser_names() -> list[str]:
    from tidal_engine.server.tool_parsers import TOOL_PARSERS

    return sorted(TOOL_PARSERS)


def reasoning_parser_names() -> list[str]:
    from tidal_engine.server.reasoning import REASONING_PARSERS

    return sorted(REASONING_PARSERS)


def chat_template_text(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the template itself (vLLM accepts both)."""
    if value is None:
        return None
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def check_unsupported(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse vLLM features Tidal lacks instead of silently ignoring them."""
    problems: list[str] = []
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        problems.append("--enable-auto-tool-choice (needs --tool-call-parser)")
    if not args.enable_lora:
        given = [flag for flag, value in (("--max-loras", args.max_loras), ("--max-lora-rank", args.max_lora_rank),
                                          ("--max-cpu-loras", args.max_cpu_loras), ("--lora-modules", args.lora_modules),
                                          ("--allowed-lora-roots", args.allowed_lora_roots)) if value is not None]
        if given:
            problems.append(f"{', '.join(given)} (needs --enable-lora)")
    if args.lora_modules:
        names = [name for name, _ in args.lora_modules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            problems.append(f"--lora-modules names {', '.join(duplicates)} more than once")
    if problems:
        parser.error("unsupported option(s): " + "; ".join(problems))


def engine_config(parser: argparse.ArgumentParser, args: argparse.Namespace, model: str,
                  served_name: str | None) -> Any:
    from tidal_engine.config import EngineConfig

    try:
        return EngineConfig(
            model=model,
            tokenizer=args.tokenizer,
            served_model_name=served_name,
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_dtype=args.kv_cache_dtype,
            enable_prefix_caching=args.enable_prefix_caching,
            enable_chunked_prefill=args.enable_chunked_prefill,
            enforce_eager=args.enforce_eager,
            async_scheduling=args.async_scheduling,
            enable_sleep_mode=args.enable_sleep_mode,
            scheduling_policy=args.scheduling_policy,
            reasoning_parser=getattr(args, "reasoning_parser", None),
            enable_lora=args.enable_lora,
            max_loras=args.max_loras or 1,
            max_lora_rank=args.max_lora_rank or 16,
            max_cpu_loras=args.max_cpu_loras,
            lora_modules=dict(args.lora_modules) if args.lora_modules else None,
            allowed_lora_roots=list(args.allowed_lora_roots) if args.allowed_lora_roots else None,
            load_format=args.load_format,
            speculative_config=args.speculative_config,
            cache_dir=args.cache_dir,
            kv_offloading_size=args.kv_offloading_size,
            kv_offloading_backend=args.kv_offloading_backend,
            kv_offloading_save=args.kv_offloading_save,
            quantization=args.quantization,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
            runner=args.runner,
            convert=args.convert,
        )
    except ValueError as exc:
        parser.error(str(exc))


def serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from tidal_engine.server.app import ServerSettings
    from tidal_engine.server.launcher import EngineStartError, serve as run_serve

    from tidal_engine.server.generation_config import read_generation_config

    api_key = args.api_key or os.environ.get("TIDAL_API_KEY") or None
    names = args.served_model_name or [args.model]
    config = engine_config(parser, args, args.model, names[0])
    try:
        chat_template = chat_template_text(args.chat_template)
        if args.generation_config not in ("auto", "vllm"):
            read_generation_config(args.generation_config, args.model)  # a bad PATH fails here, not later
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    logging.getLogger(__name__).info("loading %s", args.model)
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        served_model_names=names,
        model_source=args.model,
        api_key=api_key,
        allowed_origins=list(args.allowed_origins),
        protect_metrics=args.protect_metrics,
        max_request_body_bytes=args.max_request_body_bytes,
        log_requests=not args.disable_log_requests,
        log_prompts=args.log_prompts,
        shutdown_timeout_s=args.shutdown_timeout,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template=chat_template,
        generation_config=args.generation_config,
        metrics_prefix=args.metrics_prefix,
    )
    if resolve_runner(config) == "pooling":
        from tidal_engine.server.pooling import serve_pooling

        if args.api_server_count != 1:
            parser.error("--api-server-count must be 1 with --runner pooling")
        if config.world_size != 1:
            parser.error("--runner pooling runs on one device: drop --tensor-parallel-size and --pipeline-parallel-size")
        try:
            return serve_pooling(config, settings)
        except ValueError as exc:
            parser.error(str(exc))
    try:
        return run_serve(config, settings, args.api_server_count)
    except EngineStartError as exc:  # e.g. a bad --lora-modules entry: say why, like any bad flag
        message = str(exc)
        if "LoRAError" in message:
            parser.error(f"--lora-modules: {message.split(': ', 1)[-1]}")
        logging.getLogger(__name__).error("the engine could not start: %s", message)
        return 1


def resolve_runner(config: Any) -> str:
    """--runner auto: pooling for checkpoints that cannot generate (encoders, classifiers)."""
    if config.runner != "auto":
        return str(config.runner)
    from tidal_engine.pooling.loader import is_pooling_checkpoint

    try:
        return "pooling" if is_pooling_checkpoint(config.model) else "generate"
    except ValueError:
        return "generate"  # the generation loader reports the bad path with its own message


def generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from tidal_engine import LLM, SamplingParams

    config = engine_config(parser, args, args.model, None)
    if resolve_runner(config) == "pooling":
        parser.error(f"{args.model} is a pooling model (embeddings or scores); it cannot generate")
    options = {k: v for k, v in asdict(config).items() if k not in ("model", "runner", "convert")}
    llm = LLM(args.model, **options)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.chat})
        outputs = llm.chat(messages, params)
    else:
        outputs = llm.generate(args.prompt, params)
    for output in outputs:
        for completion in output.outputs:
            print(completion.text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    subparser: argparse.ArgumentParser = args.subparser
    check_unsupported(subparser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.trust_remote_code:
        logging.getLogger(__name__).info(
            "--trust-remote-code: accepted, but no remote code runs; Tidal serves only its built-in architectures")
    if args.command == "serve":
        return serve(subparser, args)
    return generate(subparser, args)


if __name__ == "__main__":
    sys.exit(main())
