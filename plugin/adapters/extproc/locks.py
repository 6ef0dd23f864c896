"""Operator-locked routing headers on the request path: the policy of `plugin.core.header_policy`
(gateway-wide, narrowed or lifted per model by its config document) and what a denied header
gets, a 403 or being ignored."""

from __future__ import annotations

import logging

from plugin.core.config_profile import ModelConfig
from plugin.core.header_policy import HeaderPolicy
from plugin.errors import HeaderNotAllowed

log = logging.getLogger(__name__)

__all__ = ["HeaderLock"]

REJECT, IGNORE = "reject", "ignore"


class HeaderLock:
    """Checks a request's routing headers once its model is known."""

    __slots__ = ("_ignored", "_merged", "action", "policy")

    def __init__(self, policy: HeaderPolicy | None = None, action: str = REJECT) -> None:
        self.policy = policy or HeaderPolicy()
        self.action = action
        self._ignored: set[str] = set()  # headers whose being ignored was logged
        # A model's rules over the gateway's, merged once per config object (discovery makes a
        # new object when a config changes), not per request.
        self._merged: dict[int, tuple[HeaderPolicy, HeaderPolicy]] = {}

    def check(self, model: str, config: ModelConfig | None, headers: dict[str, str]) -> None:
        """Raise HeaderNotAllowed for a denied header, or (`ignore`) take it out of `headers`."""
        own = None if config is None else config.client_headers
        policy = self.policy if own is None else self._under(own)
        if not policy:
            return
        for name in policy.denied(headers):
            if self.action == REJECT:
                raise HeaderNotAllowed(name, policy.rules[name].describe())
            del headers[name]
            if name not in self._ignored:
                self._ignored.add(name)
                log.warning(
                    "ignoring the %s header of a request for %s: its operator locked it (%s);"
                    " logged once per header",
                    name,
                    model[:256],
                    policy.rules[name].describe(),
                )

    def _under(self, own: HeaderPolicy) -> HeaderPolicy:
        found = self._merged.get(id(own))
        if found is None or found[0] is not own:
            if len(self._merged) >= 1024:  # configs long replaced
                self._merged.clear()
            found = self._merged[id(own)] = (own, self.policy.under(own))
        return found[1]
