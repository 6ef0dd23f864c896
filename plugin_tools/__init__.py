"""The tools around the plugin: simulator, mock engine, demo and benchmarks.

They may import the runtime (`plugin`); the runtime never imports them (import-linter contracts
in `pyproject.toml`, `docs/architecture.md`). Their dependencies come with the `demo` extra.
"""
