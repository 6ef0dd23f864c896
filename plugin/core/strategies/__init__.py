"""Routing strategies, registered by name so new ones plug in without touching the server.

`base` is the seam (what a strategy sees and answers, the registry); each other module holds
strategies and registers them on import. Adding one: a module here, imported below
(`docs/architecture.md`).
"""

from plugin.core.strategies import blend, load_balance, prefix_cache, simple, slo
from plugin.core.strategies.base import (
    Admission,
    Picker,
    Reject,
    Route,
    Strategy,
    Wait,
    build_strategies,
    register_strategy,
    settings_type,
    strategy_names,
)
from plugin.core.strategies.load_balance import (
    LoadBalance,
    LoadBalanceSettings,
    kv_free,
    load_balance_scores,
    with_room,
)
from plugin.core.strategies.slo import OutputHistory, SloSettings

__all__ = [
    "Admission",
    "LoadBalance",
    "LoadBalanceSettings",
    "OutputHistory",
    "Picker",
    "Reject",
    "Route",
    "SloSettings",
    "Strategy",
    "Wait",
    "blend",
    "build_strategies",
    "kv_free",
    "load_balance",
    "load_balance_scores",
    "prefix_cache",
    "register_strategy",
    "settings_type",
    "simple",
    "slo",
    "strategy_names",
    "with_room",
]
