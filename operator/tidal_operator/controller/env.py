"""The operator's configuration from TIDAL_* variables (`tidal operator` sets them from its
flags, so plain `kopf run -m tidal_operator.handlers` reads the same)."""

from __future__ import annotations

import os
from typing import Mapping

from ..api.types import OperatorConfig

ENV_DEFAULT_IMAGE = "TIDAL_DEFAULT_ENGINE_IMAGE"
ENV_ADAPTER_PREFIXES = "TIDAL_ALLOWED_ADAPTER_URI_PREFIXES"
ENV_FILE_ROOTS = "TIDAL_ALLOWED_FILE_ROOTS"
ENV_NAMESPACE = "TIDAL_NAMESPACE"
ENV_RESYNC = "TIDAL_RESYNC_SECONDS"
ENV_MAX_GPUS_PER_NODE = "TIDAL_MAX_GPUS_PER_NODE"
ENV_GPU_SHARE_DEVICE_CLASS = "TIDAL_GPU_SHARE_DEVICE_CLASS"
ENV_PRE_STOP_SLEEP = "TIDAL_PRE_STOP_SLEEP_SECONDS"
ENV_KUBECONFIG = "KUBECONFIG"


def _csv(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(x.strip() for x in value.split(",") if x.strip())


def config_from_env(env: Mapping[str, str] | None = None) -> OperatorConfig:
    """OperatorConfig from TIDAL_* variables."""
    env = os.environ if env is None else env
    base = OperatorConfig()
    return OperatorConfig(
        default_engine_image=env.get(ENV_DEFAULT_IMAGE) or base.default_engine_image,
        allowed_adapter_uri_prefixes=_csv(env.get(ENV_ADAPTER_PREFIXES)) or base.allowed_adapter_uri_prefixes,
        allowed_file_roots=_csv(env.get(ENV_FILE_ROOTS)) or base.allowed_file_roots,
        namespace=env.get(ENV_NAMESPACE) or None,
        max_gpus_per_node=int(env.get(ENV_MAX_GPUS_PER_NODE) or base.max_gpus_per_node),
        gpu_share_device_class=env.get(ENV_GPU_SHARE_DEVICE_CLASS) or base.gpu_share_device_class,
        pre_stop_sleep_seconds=_non_negative_int(env, ENV_PRE_STOP_SLEEP, base.pre_stop_sleep_seconds),
    )


def _non_negative_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a whole number of seconds") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r}: must not be negative")
    return value


def resync_seconds(env: Mapping[str, str] | None = None) -> float:
    env = os.environ if env is None else env
    return float(env.get(ENV_RESYNC) or "60")
