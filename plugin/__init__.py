"""hetero-gateway: an Envoy ext_proc plugin that routes LLM requests by learned replica capacity."""

__version__ = "0.1.0"
