"""`hetero-gateway envoy-config`: print, write or validate a bootstrap, or write every wiring
`envoy/` holds (`WIRINGS`)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

from plugin.adapters.envoy_config.options import (
    COUNT_MODES,
    STEERING_MODES,
    EnvoyOptions,
)
from plugin.adapters.envoy_config.render import (
    bootstrap_yaml,
    validate_bootstrap,
)
from plugin.config import (
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_HEADERS,
)

# --- CLI -----------------------------------------------------------------------------------------

_FLAGS: dict[str, str] = {
    "listen_host": "--listen-host",
    "listen_port": "--listen-port",
    "admin_host": "--admin-host",
    "admin_port": "--admin-port",
    "extproc_host": "--extproc-host",
    "extproc_port": "--extproc-port",
    "message_timeout_s": "--message-timeout",
    "max_message_timeout_s": "--max-message-timeout",
    "max_request_bytes": "--max-request-bytes",
    "fail_open": "--fail-open",
    "upstream_connect_timeout_s": "--upstream-connect-timeout",
    "count_mode": "--count-mode",
    "steering": "--steering",
    "endpoints": "--endpoints",
    "extproc_replicas": "--extproc-replicas",
}


def register_cli(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add `envoy-config`. Defaults are resolved in `run`, so a bad env var breaks only this."""
    d = EnvoyOptions()
    p = subparsers.add_parser(
        "envoy-config",
        help="print or write Envoy's bootstrap for the plugin",
        description="Render Envoy's bootstrap (YAML) that sends every request through the plugin.",
    )
    p.add_argument("--listen-host", default=d.listen_host, help="downstream listener IP")
    p.add_argument("--listen-port", type=int, default=d.listen_port, help="downstream port")
    p.add_argument("--admin-host", default=d.admin_host, help="Envoy admin IP")
    p.add_argument("--admin-port", type=int, default=d.admin_port, help="Envoy admin port")
    p.add_argument("--extproc-host", default=d.extproc_host, help="plugin gRPC host (IP or name)")
    p.add_argument("--extproc-port", type=int, default=d.extproc_port, help="plugin gRPC port")
    p.add_argument(
        "--extproc-replicas",
        default="",
        metavar="IP:PORT,...",
        help="several plugin replicas (sharing Redis) instead of --extproc-host/--extproc-port: "
        "Envoy spreads streams over them, health-checks them over gRPC and ejects one that "
        "refuses connections",
    )
    p.add_argument(
        "--message-timeout",
        type=float,
        default=d.message_timeout_s,
        metavar="SECONDS",
        help="ext_proc per-message timeout: how long a hung plugin can stall a request before "
        "the failure mode applies",
    )
    p.add_argument(
        "--max-message-timeout",
        type=float,
        default=d.max_message_timeout_s,
        metavar="SECONDS",
        help="the longest the plugin may extend one message's timeout (a request it holds in "
        "the SLO queue); keep it above HETERO_GATEWAY_SLO_MAX_WAIT_MS + 1 s",
    )
    # --max-request-bytes: declared with its variable; None leaves the variable in charge.
    MAX_MESSAGE_BYTES.add_flag(p, metavar="BYTES")
    p.add_argument(
        "--count-mode",
        choices=COUNT_MODES,
        default=d.count_mode,
        help="observe: a second, observability-mode filter counts tokens and Envoy never waits on "
        "the response path (default); streamed: the routing filter sees every response chunk; "
        "engine: no response chunk reaches the plugin, capacity is learned from each engine's "
        "generated-token counter (vLLM, SGLang) at every scrape",
    )
    p.add_argument(
        "--steering",
        choices=STEERING_MODES,
        default=d.steering,
        help="original-dst: connect to the IP:PORT the plugin names (default); override-host: pick "
        "among --endpoints by the plugin's envoy.lb metadata, round robin when there is no pick "
        "(with --fail-open, requests keep flowing while the plugin is down)",
    )
    p.add_argument(
        "--endpoints",
        default="",
        metavar="IP:PORT,...",
        help="every engine's endpoint, for --steering override-host",
    )
    p.add_argument(
        "--fail-open",
        action="store_true",
        help="let requests through when the plugin is unreachable (ext_proc failure_mode_allow)",
    )
    p.add_argument(
        "--upstream-connect-timeout",
        type=float,
        default=d.upstream_connect_timeout_s,
        metavar="SECONDS",
        help="connect timeout to pods and to the plugin",
    )
    p.add_argument("--out", metavar="PATH", help="write here instead of stdout")
    p.add_argument("--validate", action="store_true", help="check the result with envoy")
    p.add_argument(
        "--wirings",
        metavar="DIR",
        help="instead: write every wiring `envoy/` holds (default, fail-open override-host, "
        "engine count mode) into DIR, ignoring the other options",
    )
    p.set_defaults(func=run)


def _max_request_bytes_from_env() -> int:
    """The plugin's own setting (plugin.config), so Envoy's limit and gRPC's cannot drift."""
    from plugin.config import max_message_bytes
    from plugin.errors import ConfigError

    try:
        return max_message_bytes()
    except ConfigError as exc:
        raise SystemExit(f"hetero-gateway envoy-config: {exc}") from None


def _max_request_headers_from_env() -> int:
    from plugin.config import max_request_headers
    from plugin.errors import ConfigError

    try:
        return max_request_headers()
    except ConfigError as exc:
        raise SystemExit(f"hetero-gateway envoy-config: {exc}") from None


def _list(text: str) -> tuple[str, ...]:
    return tuple(e.strip() for e in text.split(",") if e.strip())


def options_from_args(args: argparse.Namespace) -> EnvoyOptions:
    """EnvoyOptions from parsed flags; the env vars supply --max-request-bytes when absent and
    the header count limit (the plugin reads the same variables)."""
    max_bytes = args.max_request_bytes
    if max_bytes is None:
        max_bytes = _max_request_bytes_from_env()
    try:
        return EnvoyOptions(
            listen_host=args.listen_host,
            listen_port=args.listen_port,
            admin_host=args.admin_host,
            admin_port=args.admin_port,
            extproc_host=args.extproc_host,
            extproc_port=args.extproc_port,
            message_timeout_s=args.message_timeout,
            max_message_timeout_s=args.max_message_timeout,
            max_request_bytes=max_bytes,
            max_request_headers=_max_request_headers_from_env(),
            fail_open=args.fail_open,
            count_mode=args.count_mode,
            upstream_connect_timeout_s=args.upstream_connect_timeout,
            steering=args.steering,
            endpoints=_list(args.endpoints),
            extproc_replicas=_list(args.extproc_replicas),
        )
    except ValueError as exc:
        raise SystemExit(f"hetero-gateway envoy-config: {exc}") from None


def render_command(opts: EnvoyOptions, out: str | None = None) -> str:
    """The `envoy-config` command line that renders `opts` (to `out`, if given)."""
    default = EnvoyOptions()
    parts = ["hetero-gateway envoy-config"]
    if opts.max_request_headers != default.max_request_headers:  # a variable, not a flag
        parts.insert(0, f"{MAX_REQUEST_HEADERS.name}={opts.max_request_headers}")
    for f in fields(EnvoyOptions):
        value = getattr(opts, f.name)
        if value == getattr(default, f.name) or f.name == "max_request_headers":
            continue
        flag = _FLAGS[f.name]
        if isinstance(value, tuple):
            value = ",".join(value)
        parts.append(flag if isinstance(value, bool) else f"{flag} {value}")
    if out is not None:
        parts.append(f"--out {out}")
    return " ".join(parts)


def generated_header(opts: EnvoyOptions, out: str | None = None) -> str:
    """First line of a written file: it is generated, and the command that regenerates it."""
    return f"# Generated by `{render_command(opts, out)}`; do not edit, regenerate.\n"


# The wirings `envoy/` holds, rendered (`--wirings envoy` writes them all): file -> options. The
# override-host endpoints are placeholders a reader replaces with the engines' own.
WIRINGS: dict[str, EnvoyOptions] = {
    "envoy.yaml": EnvoyOptions(),
    "envoy-override-host.yaml": EnvoyOptions(
        steering="override-host", endpoints=("10.0.0.1:8000", "10.0.0.2:8000"), fail_open=True
    ),
    "envoy-engine-count.yaml": EnvoyOptions(count_mode="engine"),
}


def wiring_text(name: str, directory: str) -> str:
    """The file `--wirings directory` writes for the wiring `name`."""
    opts = WIRINGS[name]
    return (
        f"# Generated by `hetero-gateway envoy-config --wirings {directory}`; do not edit,"
        f" regenerate.\n# This file alone: `{render_command(opts)}`.\n" + bootstrap_yaml(opts)
    )


def _write_wirings(directory: str, validate: bool) -> int:
    for name in WIRINGS:
        path = Path(directory) / name
        path.write_text(wiring_text(name, directory), encoding="utf-8")
        if validate:
            try:
                validate_bootstrap(path)
            except RuntimeError as exc:
                raise SystemExit(f"hetero-gateway envoy-config: {exc}") from None
        print(f"wrote {path}" + (": envoy accepts it" if validate else ""), file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    """Print or write the bootstrap; with --validate, Envoy must accept it or the exit is 1."""
    if args.wirings is not None:
        return _write_wirings(args.wirings, args.validate)
    opts = options_from_args(args)
    text = bootstrap_yaml(opts)
    if args.out is None:
        if args.validate:
            _validate_text(text)
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    out.write_text(generated_header(opts, args.out) + text, encoding="utf-8")
    if args.validate:
        try:
            validate_bootstrap(out)
        except RuntimeError as exc:
            raise SystemExit(f"hetero-gateway envoy-config: {exc}") from None
        print(f"{args.out}: envoy accepts it", file=sys.stderr)
    return 0


def _validate_text(text: str) -> None:
    # Envoy picks the parser by file extension, hence the .yaml suffix.
    with tempfile.TemporaryDirectory(prefix="hetero-gateway-envoy-") as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            validate_bootstrap(path)
        except RuntimeError as exc:
            raise SystemExit(f"hetero-gateway envoy-config: {exc}") from None
