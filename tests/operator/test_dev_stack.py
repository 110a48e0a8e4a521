"""Small pure parts of `tidal dev` (dev/stack.py, dev/cli.py) that a new user runs into."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from tidal_operator.dev.cli import build_arg_parser
from tidal_operator.dev.stack import Paths, curl_line, port_free


def test_a_port_just_freed_by_a_stopped_server_counts_as_free() -> None:
    # `make up` right after `tidal dev down`: the router's closed connections sit in TIME_WAIT.
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server side closes first: its end goes to TIME_WAIT
    server.close()
    client.close()
    assert port_free("127.0.0.1", port)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert not port_free("127.0.0.1", busy.getsockname()[1])


def test_the_printed_curl_asks_greedily(tmp_path: Path) -> None:
    line = curl_line("smollm2", "http://127.0.0.1:8080", Paths(tmp_path), {})
    body = json.loads(line.split("-d '", 1)[1].rstrip("'"))
    assert body["temperature"] == 0 and body["model"] == "smollm2"


def test_up_takes_file_roots_for_file_adapters() -> None:
    args = build_arg_parser().parse_args(["up", "--allow-file-root", "/srv/adapters", "--allow-file-root", "x"])
    assert args.file_roots == [Path("/srv/adapters"), Path("x")]
