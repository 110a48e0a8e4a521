"""A kubeconfig for the emulated API server: plain HTTP, no credentials."""

from __future__ import annotations

from pathlib import Path

import yaml


def kubeconfig_dict(server_url: str, *, context: str = "tidal-dev", namespace: str = "default") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": server_url}}],
        # kubectl wants a user entry even when there are no credentials.
        "users": [{"name": context, "user": {}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context, "namespace": namespace}}],
        "current-context": context,
        "preferences": {},
    }


def write_kubeconfig(path: str | Path, server_url: str, *, context: str = "tidal-dev",
                     namespace: str = "default") -> Path:
    """Write (replacing) a kubeconfig at `path` whose current context points at `server_url`."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(kubeconfig_dict(server_url, context=context, namespace=namespace),
                                     sort_keys=False))
    target.chmod(0o600)
    return target
