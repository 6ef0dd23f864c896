"""`hetero-gateway top`: a live terminal view of one plugin, from its `/debug/pods` and
`/metrics` (`view` computes, `screen` draws with rich)."""
