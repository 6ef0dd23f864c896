"""Pure decision logic: no sockets, no Redis, no protobuf, no clock calls.

Time and randomness are injected, so the server, the tests and (later) the simulator drive the
same code.
"""
