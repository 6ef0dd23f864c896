"""`hetero-gateway bench`: end-to-end figures with a real Envoy on loopback.

A benchmark, not a test: it prints and saves figures (JSON, Markdown, PNG). Every overhead and
streaming figure is a ratio against Envoy alone measured in the same command, because the
machines it runs on are shared and noisy. The modules: `client` (closed-loop HTTP load), `stats`
(pure summaries), `e2e` (the stacks and the runs), `render` (Markdown and plots), `cli`.
"""
