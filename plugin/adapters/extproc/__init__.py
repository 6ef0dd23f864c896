"""The ext_proc gRPC servicer: one processor per Envoy stream, one role per processor type.

Envoy opens a stream per request for each ext_proc filter. The routing filter's stream gets a
`RoutingProcessor` (request headers, buffered body, response headers, and the response body with
`--count-mode streamed`); the counting filter's stream, which Envoy runs in observability mode,
gets a `CountingProcessor`. The first message says which (`observability_mode`).

Only this module builds Envoy protobuf. Decisions come from `Router` (pure); token counting from
`ResponseTokens` around the pure `UsageScanner`. A request its strategy holds makes `handle`
return an awaitable instead of a reply; the servicer awaits it, so a held request costs a parked
coroutine, not a thread. Whatever ends the stream (response end, client cancel, reset, error),
`close()` releases the in-flight slot exactly once, and a held request leaves its queue.
`docs/architecture.md` follows one request through.
"""

from __future__ import annotations

from plugin.adapters.extproc.counting import (
    CountingProcessor,
)
from plugin.adapters.extproc.messages import (
    DEFAULT_MAX_HEADERS,
    ErrorCounts,
    immediate_response,
)
from plugin.adapters.extproc.routing import (
    RoutingProcessor,
)
from plugin.adapters.extproc.servicer import (
    ExtProcServicer,
)
from plugin.adapters.extproc.tokens import (
    HANDOFF_TIMEOUT_S,
    ChunkGaps,
    LeaseHandoff,
    Processor,
    Reply,
    ResponseTokens,
)

__all__ = [
    "DEFAULT_MAX_HEADERS",
    "HANDOFF_TIMEOUT_S",
    "ChunkGaps",
    "CountingProcessor",
    "ErrorCounts",
    "ExtProcServicer",
    "LeaseHandoff",
    "Processor",
    "Reply",
    "ResponseTokens",
    "RoutingProcessor",
    "immediate_response",
]
