"""The Secrets a spec refers to, and reading one value out of a Secret: written once for the
reconcile (existence), the autoscaler and the adapter sync (the engine's API key).
Values are never logged."""

from __future__ import annotations

import base64
from typing import Any, Awaitable, Callable, Mapping

from .api.types import LLMServiceSpec

ReadSecret = Callable[[str, str], Awaitable["dict[str, Any] | None"]]


def referenced_secrets(spec: Mapping[str, Any]) -> list[str]:
    """Names of the Secrets a raw spec refers to (read leniently: it may be invalid)."""
    names = []
    for parent, ref in (("auth", "apiKeySecretRef"), ("model", "hfTokenSecretRef")):
        section = spec.get(parent)
        target = section.get(ref) if isinstance(section, Mapping) else None
        if isinstance(target, Mapping) and isinstance(target.get("name"), str) and target["name"]:
            names.append(target["name"])
    return names


def secret_value(secret: Mapping[str, Any], key: str) -> str | None:
    """`data[key]` base64-decoded (or `stringData[key]`, which only a not-yet-stored body has),
    stripped of surrounding whitespace; None when absent."""
    value = (secret.get("data") or {}).get(key)
    if value:
        return base64.b64decode(value).decode().strip()
    plain = (secret.get("stringData") or {}).get(key)
    return plain.strip() if isinstance(plain, str) else None


async def engine_api_key(read_secret: ReadSecret, namespace: str, spec: LLMServiceSpec) -> str | None:
    """The key the engine Pods require (spec.auth.apiKeySecretRef), for the operator's own calls
    to them; None without auth or when the Secret is missing."""
    if spec.auth is None:
        return None
    ref = spec.auth.api_key_secret_ref
    secret = await read_secret(namespace, ref.name)
    return None if secret is None else secret_value(secret, ref.key)
