"""The README's main job: `tidal dev up -f examples/quickstart.yaml` (what `make up` runs)
brings up the whole local stack with a real engine, and the `curl` line it prints answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT, free_port


def test_make_up_prints_a_curl_that_answers(tmp_path: Path) -> None:
    def tidal(*args: str, timeout: float = 300) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "tidal_operator.cli", "dev", "--state-dir", str(tmp_path), *args],
            capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    try:
        # The same command as `make up`, on a state dir and router port of its own.
        out = tidal("up", "-f", "examples/quickstart.yaml", "--router-port", str(free_port()), "--timeout", "240")
        curl_lines = [line for line in out.splitlines() if line.startswith("curl ")]
        assert len(curl_lines) == 1, out
        assert "Authorization: Bearer" in curl_lines[0]  # the router asks for the generated key
        answer = subprocess.run(["bash", "-c", curl_lines[0]], capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0, answer.stderr
        assert "Paris" in answer.stdout, answer.stdout
    finally:
        tidal("down", timeout=120)
