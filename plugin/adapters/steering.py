"""Names of the steering protocol, shared by the ext_proc servicer that sets them and the Envoy
configuration that reads them: AIBrix's `target-pod` header (ORIGINAL_DST) and the Gateway API
Inference Extension's `envoy.lb` / `x-gateway-destination-endpoint` metadata (override_host)."""

TARGET_POD_HEADER = "target-pod"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_METADATA_NAMESPACE = "envoy.lb"
# The routing filter tells the counting filter the request's estimated prompt size, so a counted
# response teaches the output-length history (SLO routing) what size of request it answered.
PROMPT_TOKENS_HEADER = "x-hetero-gateway-prompt-tokens"
# Pick only: the routing filter tells the counting filter whose lease the request holds (the
# routing replica's gateway id) and its share of the pod, so a counting stream that reaches
# another plugin replica can take the count over (`plugin.adapters.extproc.tokens.LeaseHandoff`).
LEASE_HEADER = "x-hetero-gateway-lease"
# Pick only, a rate-limited tenant's request: what it reserved of the tenant's limits, so that
# whichever replica's counting stream sees it end settles the difference (`Router.settle_handed`).
RESERVATION_HEADER = "x-hetero-gateway-reservation"
# Dynamic metadata on the plugin's own error replies: Envoy's local-reply mappers, which turn
# Envoy's own error texts into OpenAI JSON, leave a reply that carries it as the plugin wrote it.
REPLY_METADATA_NAMESPACE = "hetero_gateway"
# gRPC metadata on the routing filter's streams when a counting filter follows it and the
# routing filter asks for no response phase: the plugin ends the routing stream at the pick and
# the counting stream holds the request's in-flight lease (plugin.adapters.extproc).
PICK_ONLY = ("x-hetero-gateway-routing", "pick-only")
# gRPC metadata on the routing filter's streams when Envoy's config takes an engine's usage-only
# chunk out of a stream whose request did not ask for one (a Lua filter, envoy_config): the
# plugin may then ask the engine for usage (`stream_options.include_usage`) on the client's
# behalf, and marks such a request with dynamic metadata `hetero_gateway.strip_usage`.
STRIPS_USAGE = ("x-hetero-gateway-usage", "strip")
STRIP_USAGE_KEY = "strip_usage"
# AIBrix's model config profile: the request names one (`config-profile`, or `auto`); the response
# reports the one it ran with (the plugin sets it on the request, Envoy's route copies it back).
CONFIG_PROFILE_HEADER = "config-profile"
PROFILE_ECHO_HEADER = "x-aibrix-config-profile"
