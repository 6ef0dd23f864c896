"""Registers `hetero-gateway serve` (heavy imports happen only when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from plugin.config import DISCOVERY_KINDS


def register_cli(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser("serve", help="run the ext_proc plugin (gRPC) with /metrics over HTTP")
    p.add_argument("--pods", help="static pods YAML file (env HETERO_GATEWAY_PODS_FILE)")
    p.add_argument(
        "--discovery",
        choices=DISCOVERY_KINDS,
        help="pod source: the --pods file, or the Kubernetes API (env HETERO_GATEWAY_DISCOVERY,"
        " default file; namespaces from HETERO_GATEWAY_K8S_NAMESPACE)",
    )
    p.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (env HETERO_GATEWAY_GRPC_PORT, 50052)")
    p.add_argument("--http-port", type=int, help="HTTP port (env HETERO_GATEWAY_HTTP_PORT, 8080)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os

    from plugin.adapters.serve import Gateway, build_source, run_until_signal
    from plugin.config import load_settings

    # A flag is its variable's value: the same validation and the same error for both.
    flags = {
        "HETERO_GATEWAY_PODS_FILE": args.pods,
        "HETERO_GATEWAY_DISCOVERY": args.discovery,
        "HETERO_GATEWAY_GRPC_PORT": args.grpc_port,
        "HETERO_GATEWAY_HTTP_PORT": args.http_port,
    }
    env = {**os.environ, **{k: str(v) for k, v in flags.items() if v is not None}}
    settings = load_settings(env)
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    source = build_source(settings)
    main = run_until_signal(Gateway(settings, source, args.host))
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
    return 0
