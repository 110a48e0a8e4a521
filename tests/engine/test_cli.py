"""`tidal-engine` command line: flag names, grouping, refusals, and what `serve` builds."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tidal_engine import cli  # noqa: E402


def run_main(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_help_groups_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for group in ("HTTP server:", "security:", "logging:", "model:", "scheduler and KV cache:", "parallelism:"):
        assert group in out
    for flag in ("--host", "--port", "--served-model-name", "--seed", "--dtype", "--device", "--max-model-len",
                 "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--gpu-memory-utilization",
                 "--kv-cache-memory-bytes", "--num-gpu-blocks-override", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
                 "--api-key", "--allowed-origins", "--enable-sleep-mode", "--disable-log-requests",
                 "--enforce-eager", "--no-protect-metrics", "--max-request-body-bytes", "--log-prompts",
                 "--shutdown-timeout", "--tensor-parallel-size", "--quantization", "--kv-cache-dtype",
                 "--enable-lora", "--load-format", "--pipeline-parallel-size"):
        assert flag in out, flag


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "m", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
        (["serve", "m", "--port", "http"], "argument --port"),
        (["serve", "m", "--port", "70000"], "port must be <= 65535"),
        (["serve", "m", "--max-num-seqs", "0"], "must be >= 1"),
        (["serve", "m", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["serve", "m", "--block-size", "24"], "invalid choice"),
        (["serve", "m", "--dtype", "int3"], "invalid choice"),
        (["serve", "m", "--kv-cache-memory-bytes", "lots"], "argument --kv-cache-memory-bytes"),
        (["serve", "m", "--device", "tpu"], "unknown device"),
        (["serve", "m", "--tensor-parallel-size", "0"], "must be >= 1"),
        (["serve", "m", "-pp", "0"], "must be >= 1"),
        (["serve", "m", "-tp", "2", "--distributed-executor-backend", "uni"], "need distributed_executor_backend 'mp'"),
        (["serve", "m", "-tp", "2", "--runner", "pooling"], "--runner pooling runs on one device"),
        (["serve", "m", "--quantization", "int8"], "argument --quantization/-q: invalid choice: 'int8'"),
        (["serve", "m", "--kv-cache-dtype", "fp8_e5m2"], "argument --kv-cache-dtype: invalid choice"),
        (["serve", "m", "--max-loras", "4"], "--max-loras (needs --enable-lora)"),
        (["serve", "m", "--enable-lora", "--lora-modules", "sql"], "expected name=path"),
        (["serve", "m", "--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names a more than once"),
        (["serve", "m", "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "must be >= max_loras"),
        (["serve", "m", "--kv-offloading-size", "0"], "kv_offloading_size must be > 0 GiB"),
        (["serve", "m", "--kv-offloading-size", "4", "--no-enable-prefix-caching"], "KV offloading needs prefix caching"),
        (["serve", "m", "--kv-offloading-size", "4", "-tp", "2"], "KV offloading runs with one worker"),
        (["serve", "m", "--kv-offloading-backend", "lmcache"], "argument --kv-offloading-backend: invalid choice"),
        (["serve"], "required: model"),
        (["generate", "--model", "m"], "one of the arguments --prompt --chat is required"),
        (["launch"], "invalid choice"),
    ],
)
def test_bad_command_lines_exit_nonzero_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing may get as far as loading a model.
    monkeypatch.setattr("tidal_engine.server.launcher.serve",
                        lambda *args, **kwargs: pytest.fail("should not start the engine"))
    assert run_main(argv) == 2
    assert message in capsys.readouterr().err


def test_supported_values_of_unsupported_features_are_accepted() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "m", "--quantization", "none",
                              "--kv-cache-dtype", "auto"])
    cli.check_unsupported(args.subparser, args)  # no SystemExit


def test_serve_maps_flags_to_config_and_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    captured: dict[str, Any] = {}

    def fake_serve(config: Any, settings: Any, api_server_count: int) -> int:
        captured.update(config=config, settings=settings, api_server_count=api_server_count)
        return 0

    monkeypatch.setattr("tidal_engine.server.launcher.serve", fake_serve)
    monkeypatch.setenv("TIDAL_API_KEY", "from-env")
    code = run_main([
        "serve", "smollm2-135m", "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "smol", "alias",
        "--seed", "7", "--dtype", "bfloat16", "--device", "cpu", "--max-model-len", "512", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "1024", "--block-size", "32", "--gpu-memory-utilization", "0.5",
        "--kv-cache-memory-bytes", "2Gi", "--num-gpu-blocks-override", "100", "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill", "--enable-sleep-mode", "--enforce-eager", "--no-async-scheduling", "--allowed-origins",
        "https://a.example", "--no-protect-metrics", "--disable-log-requests", "--max-request-body-bytes", "1M",
        "--shutdown-timeout", "5", "--api-server-count", "3", "--distributed-executor-backend", "mp",
        "--kv-cache-dtype", "fp8",
    ])
    assert code == 0
    assert captured["api_server_count"] == 3 and captured["config"].distributed_executor_backend == "mp"
    config, settings = captured["config"], captured["settings"]
    assert (config.model, config.served_model_name, config.seed, config.dtype, config.device) == (
        "smollm2-135m", "smol", 7, "bfloat16", "cpu")
    assert (config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (
        512, 8, 1024, 32)
    assert config.gpu_memory_utilization == 0.5 and config.kv_cache_memory_bytes == 2 << 30
    assert config.num_gpu_blocks_override == 100 and config.kv_cache_dtype == "fp8"
    assert not config.enable_prefix_caching and not config.enable_chunked_prefill
    assert config.enable_sleep_mode and config.enforce_eager
    assert config.async_scheduling is False  # None (the default) means: on with CUDA
    assert (settings.host, settings.port, settings.served_model_names) == ("0.0.0.0", 9000, ["smol", "alias"])
    assert settings.api_key == "from-env"
    assert settings.allowed_origins == ["https://a.example"]
    assert not settings.protect_metrics and not settings.log_requests
    assert settings.max_request_body_bytes == 10**6 and settings.shutdown_timeout_s == 5


def test_kv_offloading_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    captured: dict[str, Any] = {}
    monkeypatch.setattr("tidal_engine.server.launcher.serve",
                        lambda config, settings, api_server_count: captured.update(config=config) or 0)
    assert run_main(["serve", "m", "--kv-offloading-size", "2.5", "--kv-offloading-backend", "native",
                     "--kv-offloading-save", "eviction"]) == 0
    config = captured["config"]
    assert config.kv_offloading_size == 2.5 and config.kv_offloading_backend == "native"
    assert config.kv_offloading_save == "eviction"


def test_api_key_flag_beats_env_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    captured: dict[str, Any] = {}
    monkeypatch.setattr("tidal_engine.server.launcher.serve", lambda c, s, n: captured.setdefault("s", s) and 0)
    monkeypatch.setenv("TIDAL_API_KEY", "from-env")
    assert run_main(["serve", "m", "--api-key", "from-flag"]) == 0
    settings = captured["s"]
    assert settings.api_key == "from-flag"
    assert settings.host == "127.0.0.1" and settings.port == 8000
    assert settings.protect_metrics and settings.log_requests and not settings.log_prompts
    assert settings.allowed_origins == []


def test_generate_prints_text(capsys: pytest.CaptureFixture[str]) -> None:
    from test_server_support import tiny_model_dir

    folder = tiny_model_dir()
    code = run_main(["generate", "--model", folder, "--prompt", "Hello", "--max-tokens", "5", "--device", "cpu",
                     "--kv-cache-memory-bytes", "8M"])
    assert code == 0
    assert capsys.readouterr().out.strip()
    code = run_main(["generate", "--model", folder, "--chat", "Hi", "--system", "Be brief.", "--max-tokens", "3",
                     "--kv-cache-memory-bytes", "8M", "--n", "2", "--temperature", "0.7"])
    assert code == 0
    assert len(capsys.readouterr().out.strip().splitlines()) >= 1


def test_curl_hint_never_contains_the_key() -> None:
    from tidal_engine.server.app import curl_hint

    line = curl_hint("0.0.0.0", 8000, "smollm2-135m", with_key=True)
    assert line.startswith("curl -s http://localhost:8000/v1/chat/completions")
    assert "$TIDAL_API_KEY" in line and '"model": "smollm2-135m"' in line


def test_chat_output_flags_reach_the_server_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    captured: dict[str, Any] = {}
    monkeypatch.setattr("tidal_engine.server.launcher.serve", lambda c, s, n: captured.update(c=c, s=s) or 0)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6}')
    with caplog.at_level("INFO"):
        assert run_main(["serve", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--reasoning-parser", "qwen3", "--chat-template", str(template), "--tokenizer", "tok",
                         "--generation-config", str(tmp_path), "--trust-remote-code",
                         "--scheduling-policy", "priority", "--metrics-prefix", "vllm"]) == 0
    settings = captured["s"]
    assert settings.enable_auto_tool_choice and settings.tool_call_parser == "hermes"
    assert settings.reasoning_parser == "qwen3" and settings.chat_template == template.read_text()
    assert settings.generation_config == str(tmp_path)
    assert captured["c"].tokenizer == "tok" and captured["c"].scheduling_policy == "priority"
    assert settings.metrics_prefix == "vllm"
    assert "only its built-in architectures" in caplog.text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "m", "--enable-auto-tool-choice"], "needs --tool-call-parser"),
        (["serve", "m", "--tool-call-parser", "nope"], "invalid choice"),
        (["serve", "m", "--reasoning-parser", "nope"], "invalid choice"),
        (["serve", "m", "--generation-config", "/no/such/dir"], "--generation-config /no/such/dir"),
        (["serve", "m", "--chat-template", "not-a-file"], "neither a file nor a Jinja template"),
    ],
)
def test_bad_chat_output_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tidal_engine.server.launcher.serve",
                        lambda *args, **kwargs: pytest.fail("should not start the engine"))
    assert run_main(argv) == 2
    assert message in capsys.readouterr().err
