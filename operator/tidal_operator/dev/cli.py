"""`tidal dev up | down | status`: the local stack (emulated API server, local kubelet,
operator, router) for trying Tidal on a laptop and for the end-to-end tests."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Sequence

from .stack import DEFAULT_CRDS, DEFAULT_EXAMPLE, StackError, UpOptions, down, status, up


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="tidal dev", description="Tidal's local control plane.")
    p.add_argument("--state-dir", type=Path, default=Path(".tidal"),
                   help="where the kubeconfig, pidfiles, logs and API key live (default: .tidal)")
    sub = p.add_subparsers(dest="dev_command", required=True)
    u = sub.add_parser("up", help="start the stack (or reuse it), apply files, wait for Ready")
    u.add_argument("-f", "--filename", dest="files", action="append", type=Path, default=None,
                   help=f"manifest to apply (repeatable; default: {DEFAULT_EXAMPLE.name})")
    u.add_argument("--no-apply", action="store_true", help="start the stack only")
    u.add_argument("--no-router", action="store_true", help="do not start the router")
    u.add_argument("--fake-engines", action="store_true",
                   help="the kubelet runs no processes and marks Pods Ready at once (fast, for tests)")
    u.add_argument("--engine-command", default="", metavar="WORDS",
                   help="run this (shell words) instead of tidal-engine in engine Pods, with the same "
                        "arguments: engine stand-ins for benchmarks; takes effect when the control plane starts")
    u.add_argument("--router-port", type=int, default=8080)
    u.add_argument("--api-port", type=int, default=0, help="the API server's port (default: a free one)")
    u.add_argument("--crds", type=Path, default=DEFAULT_CRDS)
    u.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for Ready (default 300)")
    u.add_argument("--allow-file-root", dest="file_roots", action="append", type=Path, default=[], metavar="DIR",
                   help="a directory file:// LoRA adapters may come from (repeatable; the operator's "
                        "--allowed-file-root; takes effect when the operator starts)")
    sub.add_parser("down", help="stop everything `up` started, engine processes included")
    sub.add_parser("status", help="what is running, and the LLMServices")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    try:
        if args.dev_command == "up":
            files = args.files or [DEFAULT_EXAMPLE]
            up(UpOptions(files=files, state_dir=args.state_dir, api_port=args.api_port,
                         router_port=args.router_port, router=not args.no_router, fake_engines=args.fake_engines,
                         engine_command=tuple(shlex.split(args.engine_command)),
                         apply=not args.no_apply, wait_s=args.timeout, crds=args.crds,
                         allowed_file_roots=tuple(args.file_roots)))
        elif args.dev_command == "down":
            down(args.state_dir)
        else:
            status(args.state_dir)
    except StackError as exc:
        print(f"tidal dev: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
