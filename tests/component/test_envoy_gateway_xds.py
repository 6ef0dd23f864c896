"""deploy/ under Envoy Gateway, checked without a cluster: the xDS Envoy Gateway would generate
for our manifests, our EnvoyPatchPolicies applied to it, and the result validated by Envoy.

`EgModel` builds the Gateway listener, its route configuration and clusters the way Envoy
Gateway's translator does for the version our CRDs pin, written here in our own words from what
its translator test data shows (docs/deploy.md, "Protections under Envoy Gateway"): each extProc
entry of the EnvoyExtensionPolicy becomes an HTTP filter named
`envoy.filters.http.ext_proc/envoyextensionpolicy/<ns>/<policy>/extproc/<i>`, disabled on the
listener and enabled per route with an empty `FilterConfig`; the connection manager of a plain
HTTP listener sits at `/default_filter_chain/filters/0/typed_config` of listener
`<ns>/<gateway>/<listener>`, whose route configuration has the same name. It is derived from the
rendered EnvoyExtensionPolicy, so a change there shows here.

Every EnvoyPatchPolicy of an overlay is applied as Envoy Gateway applies one (a JSON Patch; with
`jsonPath`, at each node it selects, `path` relative to that node; a selector that matches
nothing fails here), and the patched protections must equal what `hetero-gateway envoy-config`
renders for the standalone bootstrap. Then the whole, as a static bootstrap (the route
configuration inline instead of RDS), goes through `envoy --mode validate`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from plugin.adapters.envoy_config import (
    EnvoyOptions,
    render_bootstrap,
    validate_bootstrap,
)
from plugin.adapters.envoy_config.options import COUNT_FILTER
from plugin.adapters.steering import PICK_ONLY
from plugin.config import MAX_REQUEST_HEADERS
from tests.envoy_gateway import EgModel, Xds, patched
from tests.helpers import Kustomize, bootstrap_hcm, one, routing_filter

pytestmark = pytest.mark.component

PATCHED_OVERLAYS = ("original-dst", "shared-state")


# --- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", PATCHED_OVERLAYS)
def test_patched_gateway_has_the_standalone_protections(overlay: str, render: Kustomize) -> None:
    xds = patched(render(overlay))
    model = xds.model
    standalone = render_bootstrap(EnvoyOptions())
    mine = routing_filter(standalone)
    routing = xds.http_filter(model.filter_name(0))
    # A hung plugin stalls a request as long as in the standalone bootstrap; held requests may
    # ask for as long.
    assert routing["message_timeout"] == mine["message_timeout"]
    assert routing["max_message_timeout"] == mine["max_message_timeout"]
    # Pick only: no response phase, the plugin told so.
    assert routing["processing_mode"]["response_header_mode"] == "SKIP"
    metadata = {(m["key"], m["value"]) for m in routing["grpc_service"]["initial_metadata"]}
    assert PICK_ONLY in metadata
    # What the policy set is kept.
    assert routing["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert routing["status_on_error"] == {"code": "ServiceUnavailable"}
    # The counting filter closes a cancelled request's stream as soon.
    count = next(f for f in bootstrap_hcm(standalone)["http_filters"] if f["name"] == COUNT_FILTER)
    counting = xds.http_filter(model.filter_name(1))
    assert counting["observability_mode"] is True
    assert counting["deferred_close_timeout"] == count["typed_config"]["deferred_close_timeout"]
    # Header room: the listener's limit is the plugin's (the ConfigMap tells the plugin).
    hcm = xds.listener["default_filter_chain"]["filters"][0]["typed_config"]
    limit = hcm["common_http_protocol_options"]["max_headers_count"]
    assert limit == MAX_REQUEST_HEADERS.default
    config = one(render(overlay), "ConfigMap", "hetero-gateway-env")
    assert config["data"][MAX_REQUEST_HEADERS.name] == str(limit)
    # The routed response headers come from the route, as in the standalone bootstrap.
    theirs = bootstrap_hcm(standalone)["route_config"]["virtual_hosts"][0]["routes"][0]
    rule0 = [r for r in xds.routes["virtual_hosts"][0]["routes"] if "/rule/0/" in r["name"]]
    assert rule0 and all(
        r["response_headers_to_add"] == theirs["response_headers_to_add"] for r in rule0
    )
    # Envoy's own errors in OpenAI's shape (deploy/components/openai-errors).
    assert hcm["local_reply_config"]["mappers"]


@pytest.mark.parametrize("overlay", PATCHED_OVERLAYS)
def test_envoy_accepts_the_patched_gateway(
    overlay: str, render: Kustomize, tmp_path: Path, envoy_binary: str
) -> None:
    path = tmp_path / "envoy-gateway.yaml"
    path.write_text(yaml.safe_dump(patched(render(overlay)).bootstrap(), sort_keys=False))
    validate_bootstrap(path)


def test_the_model_itself_is_a_configuration_envoy_accepts(
    render: Kustomize, tmp_path: Path, envoy_binary: str
) -> None:
    """Unpatched (EnvoyPatchPolicy off): what the policies alone give, also valid."""
    xds = Xds(EgModel(render("override-host")))
    path = tmp_path / "unpatched.yaml"
    path.write_text(yaml.safe_dump(xds.bootstrap(), sort_keys=False))
    validate_bootstrap(path)
    assert xds.http_filter(xds.model.filter_name(0))["message_timeout"] == "60s"


def test_a_patch_whose_filter_is_gone_fails_here(render: Kustomize) -> None:
    """Renaming the EnvoyExtensionPolicy renames Envoy Gateway's filters: the patches would
    select nothing, and Envoy Gateway would leave the protections out."""
    objects = render("original-dst")
    one(objects, "EnvoyExtensionPolicy")["metadata"]["name"] = "renamed"
    xds = Xds(EgModel(objects))
    policy = next(o for o in objects if o["metadata"]["name"] == "hetero-gateway-protections")
    with pytest.raises(AssertionError, match="selects nothing"):
        xds.apply(policy)
