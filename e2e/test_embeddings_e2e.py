"""A chat model and an embedding model side by side on `tidal dev` with real engines: both
behind the router, each answering its own API, and `kubectl get llm -o wide` showing the task."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
READY_BOUND_S = 180  # two real engines starting on 2 shared CPU cores

pytestmark = pytest.mark.slow


def _post(url: str, path: str, key: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_chat_and_embeddings_behind_one_router(real_stack: Any) -> None:
    real_stack.kubectl("apply", "-f", str(ROOT / "examples" / "quickstart.yaml"),
                       "-f", str(ROOT / "examples" / "embeddings-minilm.yaml"))
    real_stack.wait_ready("smollm2", READY_BOUND_S)
    real_stack.wait_ready("minilm", READY_BOUND_S)

    (pod,) = real_stack.pods("minilm")
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--runner") + 1] == "pooling" and args[args.index("--convert") + 1] == "embed"
    # Cells by the header's character offsets: `tidal dev` applies no schema defaults, so the
    # quickstart's unset task is an empty cell there (a real API server shows "generate").
    header, *rows = real_stack.kubectl("get", "llm", "-o", "wide").splitlines()
    start = header.index("TASK")
    following = header[start:].split()[1:]
    end = header.index(following[0], start) if following else None
    tasks = {row.split()[0]: row[start:end].strip() for row in rows}
    assert tasks["minilm"] == "embed" and tasks["smollm2"] in ("", "generate")

    url, key = real_stack.router_url, real_stack.api_key
    embedded = _post(url, "/v1/embeddings", key, {"model": "minilm", "input": ["the tide", "the sea"]})
    assert [len(d["embedding"]) for d in embedded["data"]] == [384, 384]
    assert "Paris" in real_stack.chat(url, "smollm2", key)
    with pytest.raises(urllib.error.HTTPError) as wrong:  # the embedding model does not chat
        real_stack.chat(url, "minilm", key)
    assert wrong.value.code == 400
