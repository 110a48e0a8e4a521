"""The `tidal` command: `tidal operator | router | dev`.

Imports are deferred to the chosen subcommand, so `tidal dev` starts without loading kopf,
and `tidal operator` can set $KUBECONFIG before any client library reads it.
"""

from __future__ import annotations

import argparse
import getpass
import logging
import os
import socket
import sys
from typing import Sequence

USAGE = """usage: tidal {operator,router,dev} [options]

  operator   reconcile LLMServices into engine Pods (kopf)
  router     one OpenAI-compatible endpoint for every model
  dev        the local stack: tidal dev up [-f FILE] | down | status

`tidal <command> --help` for each command's options."""


def operator_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal operator", description="Reconcile LLMServices into engine Pods.")
    p.add_argument("--kubeconfig", default=None, help="default: $KUBECONFIG, in-cluster, or ~/.kube/config")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--namespace", "-n", action="append", default=[],
                       help="serve only this namespace (repeatable; kopf glob patterns work)")
    where.add_argument("--all-namespaces", "-A", action="store_true", help="serve every namespace (the default)")
    peering = p.add_mutually_exclusive_group()
    peering.add_argument("--standalone", action="store_true",
                         help="no peering: for a single replica (and `tidal dev`)")
    peering.add_argument("--peering", default=None, metavar="NAME",
                         help="require the kopf peering object NAME (default: use 'tidal-operator' if the "
                              "KopfPeering CRDs exist, else run standalone)")
    p.add_argument("--priority", type=int, default=0, help="peering priority: the highest live one is active")
    p.add_argument("--default-engine-image", default=None, help="engine image when a spec names none")
    p.add_argument("--allowed-adapter-uri-prefix", action="append", default=None,
                   help="a prefix LoRA adapter URIs may start with (repeatable; default hf://, pvc://, bundled://)")
    p.add_argument("--allowed-file-root", action="append", default=None,
                   help="a directory file:// adapters may come from (repeatable; default none)")
    p.add_argument("--resync-seconds", type=float, default=60.0,
                   help="the safety-net resync of every LLMService (unsettled ones: every 5s)")
    p.add_argument("--pre-stop-sleep-seconds", type=int, default=None, metavar="S",
                   help="how long an engine Pod's preStop hook waits before SIGTERM, so endpoints and routers "
                        "stop sending to it first (default 5)")
    p.add_argument("--liveness", default=None, metavar="URL",
                   help="kopf's liveness endpoint, for example http://0.0.0.0:8081/healthz")
    p.add_argument("--verbose", "-v", action="store_true")
    p.add_argument("--quiet", "-q", action="store_true")
    return p


DEFAULT_PEERING = "tidal-operator"


def run_operator(argv: Sequence[str]) -> int:
    args = operator_arg_parser().parse_args(argv)
    # The handlers read their configuration from the environment (so plain `kopf run` works too).
    from .controller.env import (ENV_ADAPTER_PREFIXES, ENV_DEFAULT_IMAGE, ENV_FILE_ROOTS, ENV_NAMESPACE,
                                 ENV_PRE_STOP_SLEEP, ENV_RESYNC)
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = os.path.abspath(args.kubeconfig)
    if args.default_engine_image:
        os.environ[ENV_DEFAULT_IMAGE] = args.default_engine_image
    if args.allowed_adapter_uri_prefix:
        os.environ[ENV_ADAPTER_PREFIXES] = ",".join(args.allowed_adapter_uri_prefix)
    if args.allowed_file_root:
        os.environ[ENV_FILE_ROOTS] = ",".join(args.allowed_file_root)
    if len(args.namespace) == 1:
        os.environ[ENV_NAMESPACE] = args.namespace[0]
    os.environ[ENV_RESYNC] = str(args.resync_seconds)
    if args.pre_stop_sleep_seconds is not None:
        if args.pre_stop_sleep_seconds < 0:
            operator_arg_parser().error("--pre-stop-sleep-seconds must not be negative")
        os.environ[ENV_PRE_STOP_SLEEP] = str(args.pre_stop_sleep_seconds)

    import kopf

    from . import handlers

    kopf.configure(verbose=args.verbose, quiet=args.quiet)
    # kopf's identity: the Pod name in a cluster (POD_ID from the downward API), else user@host/pid.
    identity = os.environ.get("POD_ID") or f"{getpass.getuser()}@{socket.gethostname()}/{os.getpid()}"
    handlers.OPERATOR_IDENTITY = identity
    settings = kopf.OperatorSettings()
    settings.peering.name = args.peering or DEFAULT_PEERING
    settings.peering.priority = args.priority
    kopf.run(
        settings=settings,
        standalone=True if args.standalone else None,
        peering_name=args.peering,  # explicit: mandatory; None: auto-detect by the CRDs' presence
        priority=args.priority,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
        identity=identity,  # type: ignore[arg-type]
    )
    return 0


def run_router(argv: Sequence[str]) -> int:
    from .router.app import main as router_main
    router_main(list(argv))
    return 0


def run_dev(argv: Sequence[str]) -> int:
    from .dev.cli import main as dev_main
    return dev_main(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    commands = {"operator": run_operator, "router": run_router, "dev": run_dev}
    if command not in commands:
        print(f"tidal: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    logging.captureWarnings(True)
    return commands[command](rest)


if __name__ == "__main__":
    sys.exit(main())
