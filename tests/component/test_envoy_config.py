"""Envoy bootstrap rendering: the facts that matter, and the real Envoy accepts the result."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugin.adapters import envoy_config as ec
from plugin.adapters.envoy_config import EnvoyOptions, bootstrap_yaml, render_bootstrap
from plugin.adapters.envoy_config import options as envoy_options
from plugin.core.limits import HEADERS as LIMIT_HEADERS
from tests.helpers import REPO, bootstrap_hcm, routing_filter

pytestmark = pytest.mark.component

CHECKED_IN = REPO / "envoy" / "envoy.yaml"


def _parser() -> argparse.ArgumentParser:
    # Only this module's sub-command: the test must not depend on the other CLI modules.
    parser = argparse.ArgumentParser(prog="hetero-gateway")
    ec.register_cli(parser.add_subparsers(dest="command", required=True))
    return parser


def _run_cli(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return int(args.func(args))


def _cluster(boot: dict[str, Any], name: str) -> dict[str, Any]:
    (cluster,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == name]
    assert isinstance(cluster, dict)
    return cluster


def _strip_comments(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#"))


# --- facts ----------------------------------------------------------------------------------------


def test_steering_reads_target_pod_header_from_original_dst_cluster() -> None:
    boot = render_bootstrap(EnvoyOptions())
    cluster = _cluster(boot, ec.ORIGINAL_DST_CLUSTER)
    assert cluster["type"] == "ORIGINAL_DST"
    assert cluster["lb_policy"] == "CLUSTER_PROVIDED"
    assert cluster["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": "target-pod",
    }
    routes = bootstrap_hcm(boot)["route_config"]["virtual_hosts"][0]["routes"]
    route = routes[0]
    assert route["match"] == {"path": "/v1/chat/completions"}
    assert route["route"]["cluster"] == ec.ORIGINAL_DST_CLUSTER
    assert route["route"]["timeout"] == "0s"  # the whole streamed answer must not be cut
    # Only the OpenAI paths reach a cluster; anything else is Envoy's own OpenAI-shaped 404.
    assert [r["match"] for r in routes] == [
        {"path": "/v1/chat/completions"},
        {"path": "/v1/completions"},
        {"path": "/v1/responses"},
        {"path": "/v1/models"},
        {"prefix": "/"},
    ]
    not_found = routes[-1]["direct_response"]
    assert not_found["status"] == 404
    assert not_found["body"]["inline_string"].startswith("not found: this gateway serves")
    # Envoy's own replies (this 404 included) become OpenAI JSON through the local-reply
    # mappers; each skips replies carrying the plugin's metadata (its own, already JSON).
    mappers = bootstrap_hcm(boot)["local_reply_config"]["mappers"]
    statuses = []
    for mapper in mappers:
        status_filter, plugin_filter = mapper["filter"]["and_filter"]["filters"]
        assert plugin_filter["metadata_filter"]["matcher"]["filter"] == "hetero_gateway"
        assert plugin_filter["metadata_filter"]["match_if_key_not_found"] is True
        statuses.append(json.dumps(status_filter, sort_keys=True))
        error = mapper["body_format_override"]["json_format"]["error"]
        assert set(error) == {"message", "type", "param", "code"}
    assert len(set(statuses)) == len(mappers)


STRIP = "hetero_gateway.strip_usage"


@pytest.mark.parametrize(
    ("count_mode", "names", "routing_body_mode", "routing_header_mode"),
    [
        (
            "observe",
            [STRIP, "envoy.filters.http.ext_proc", ec.COUNT_FILTER, "envoy.filters.http.router"],
            "NONE",
            "SKIP",  # pick only: the counting filter sees the response
        ),
        (
            "streamed",
            [STRIP, "envoy.filters.http.ext_proc", "envoy.filters.http.router"],
            "STREAMED",
            "SEND",
        ),
        (
            "engine",
            ["envoy.filters.http.ext_proc", ec.COUNT_FILTER, "envoy.filters.http.router"],
            "NONE",
            "SKIP",
        ),
    ],
    ids=["observe", "streamed", "engine"],
)
def test_ext_proc_filter_modes_metadata_and_timeouts(
    count_mode: str, names: list[str], routing_body_mode: str, routing_header_mode: str
) -> None:
    boot = render_bootstrap(EnvoyOptions(count_mode=count_mode))
    filters = bootstrap_hcm(boot)["http_filters"]
    assert [f["name"] for f in filters] == names
    by_name = {f["name"]: f["typed_config"] for f in filters}
    cfg = by_name["envoy.filters.http.ext_proc"]
    assert cfg["@type"].endswith("envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor")
    assert cfg["grpc_service"]["envoy_grpc"] == {"cluster_name": ec.EXT_PROC_CLUSTER}
    assert cfg["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "response_header_mode": routing_header_mode,
        "response_body_mode": routing_body_mode,
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }
    namespaces = cfg["metadata_options"]["receiving_namespaces"]["untyped"]
    assert namespaces == ["envoy.lb", "hetero_gateway"]
    assert cfg["message_timeout"] == "1s"  # a hung plugin stalls a request this long at most
    assert cfg["max_message_timeout"] == "60s"  # a held request's reply may take this long
    assert cfg["failure_mode_allow"] is False
    assert cfg["status_on_error"] == {"code": 503}
    assert cfg["allow_mode_override"] is False
    routes = bootstrap_hcm(boot)["route_config"]["virtual_hosts"][0]["routes"]
    added = {h["header"]["key"] for h in routes[0].get("response_headers_to_add", [])}
    # The plugin learns from gRPC metadata that this filter only picks, and whether Envoy takes
    # usage chunks out of the streams it marks (only where the plugin counts response bodies).
    metadata = cfg["grpc_service"].get("initial_metadata", [])
    assert ({"key": "x-hetero-gateway-usage", "value": "strip"} in metadata) is (STRIP in names)
    assert ({"key": "x-hetero-gateway-routing", "value": "pick-only"} in metadata) is (
        count_mode != "streamed"
    )
    if count_mode != "streamed":
        # The response headers the plugin set in its response-headers reply come from the route.
        assert added == {
            "request-id",
            "routing-strategy",
            "target-pod",
            "target-pod-ip",
            "x-aibrix-config-profile",
            *LIMIT_HEADERS,
        }
    else:
        assert not added
    if count_mode != "streamed":
        count = by_name[ec.COUNT_FILTER]
        assert count["observability_mode"] is True
        assert count["failure_mode_allow"] is True  # counting must never fail a response
        assert count["processing_mode"]["request_body_mode"] == "NONE"
        body = "NONE" if count_mode == "engine" else "STREAMED"
        assert count["processing_mode"]["response_body_mode"] == body
        # Without a body the stream's end is the response's end: it closes at once. With one,
        # a cancelled request's slot must not wait out Envoy's 5 s default.
        close = ec.ENGINE_COUNT_CLOSE_S if count_mode == "engine" else ec.OBSERVE_COUNT_CLOSE_S
        assert count["deferred_close_timeout"] == f"{close}s"
    if STRIP in names:
        assert by_name[STRIP]["@type"].endswith("envoy.extensions.filters.http.lua.v3.Lua")


@pytest.mark.parametrize("count_mode", ["streamed", "engine"])
def test_other_count_modes_validate_with_envoy(
    count_mode: str, tmp_path: Path, envoy_binary: str
) -> None:
    path = tmp_path / f"{count_mode}.yaml"
    path.write_text(bootstrap_yaml(EnvoyOptions(count_mode=count_mode)))
    ec.validate_bootstrap(path)


@pytest.mark.parametrize("max_bytes", [4 * 1024 * 1024, 16 * 1024 * 1024], ids=["4MiB", "16MiB"])
def test_buffer_limits_and_windows_follow_max_request_bytes(max_bytes: int) -> None:
    boot = render_bootstrap(EnvoyOptions(max_request_bytes=max_bytes))
    assert boot["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] == (
        max_bytes
    )
    assert _cluster(boot, ec.ORIGINAL_DST_CLUSTER)["per_connection_buffer_limit_bytes"] == (
        max_bytes
    )
    ext = _cluster(boot, ec.EXT_PROC_CLUSTER)
    proto = ext["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    h2 = proto["explicit_http_config"]["http2_protocol_options"]
    assert h2["initial_stream_window_size"] > max_bytes
    assert h2["initial_connection_window_size"] >= h2["initial_stream_window_size"]


@pytest.mark.parametrize(
    ("host", "kind"),
    [("127.0.0.1", "STATIC"), ("::1", "STATIC"), ("gateway-plugin.aibrix-system", "STRICT_DNS")],
    ids=["ipv4", "ipv6", "dns-name"],
)
def test_ext_proc_cluster_address(host: str, kind: str) -> None:
    ext = _cluster(render_bootstrap(EnvoyOptions(extproc_host=host)), ec.EXT_PROC_CLUSTER)
    assert ext["type"] == kind
    endpoint = ext["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {"address": host, "port_value": 50052}


def test_plugin_replicas_share_one_health_checked_cluster() -> None:
    """Several replicas: one endpoint each, gRPC health checks (a draining replica says
    NOT_SERVING), a refused connection ejects at once; one plugin gets neither."""
    replicas = ("10.0.0.1:50052", "10.0.0.2:50053")
    ext = _cluster(render_bootstrap(EnvoyOptions(extproc_replicas=replicas)), ec.EXT_PROC_CLUSTER)
    endpoints = ext["load_assignment"]["endpoints"][0]["lb_endpoints"]
    addresses = [e["endpoint"]["address"]["socket_address"] for e in endpoints]
    assert addresses == [
        {"address": "10.0.0.1", "port_value": 50052},
        {"address": "10.0.0.2", "port_value": 50053},
    ]
    assert ext["type"] == "STATIC"
    assert ext["health_checks"][0]["grpc_health_check"] == {}
    assert ext["outlier_detection"]["consecutive_local_origin_failure"] == 1
    single = _cluster(render_bootstrap(EnvoyOptions()), ec.EXT_PROC_CLUSTER)
    assert "health_checks" not in single and "outlier_detection" not in single


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(60.0, "60s"), (0.2, "0.2s"), (0.0, "0s"), (1.5, "1.5s"), (1e-12, "0s")],
    ids=["whole", "fraction", "zero", "one-and-half", "sub-nanosecond"],
)
def test_durations(seconds: float, text: str) -> None:
    assert envoy_options._duration(seconds) == text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"listen_host": "localhost"},
        {"listen_port": 70000},
        {"message_timeout_s": 4000.0},
        {"max_request_bytes": 0},
        {"upstream_connect_timeout_s": 0.0},
        {"extproc_host": ""},
        {"steering": "maglev"},
        {"steering": "override-host"},
        {"steering": "override-host", "endpoints": ("engine-0:8000",)},
        {"endpoints": ("10.0.0.1",)},
        {"extproc_replicas": ("plugin-0:50052",)},
    ],
    ids=[
        "listen-host-not-ip",
        "port-range",
        "timeout-over-3600",
        "zero-bytes",
        "connect-0",
        "host",
        "steering",
        "override-host-without-endpoints",
        "endpoint-not-ip",
        "endpoint-without-port",
        "replica-not-ip",
    ],
)
def test_bad_options_are_rejected_early(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        EnvoyOptions(**kwargs)


@pytest.mark.parametrize("name", sorted(ec.WIRINGS))
def test_each_checked_in_wiring_is_what_the_renderer_prints_and_envoy_accepts(name: str) -> None:
    path = REPO / "envoy" / name
    text = path.read_text(encoding="utf-8")
    assert text == ec.wiring_text(name, "envoy"), (
        f"envoy/{name} drifted: run `hetero-gateway envoy-config --wirings envoy`"
    )
    assert _strip_comments(text) == bootstrap_yaml(ec.WIRINGS[name])
    ec.validate_bootstrap(path)


def test_the_default_wiring_is_the_default_rendering() -> None:
    assert _strip_comments(CHECKED_IN.read_text(encoding="utf-8")) == bootstrap_yaml(EnvoyOptions())


def test_one_command_writes_every_wiring(tmp_path: Path) -> None:
    assert _run_cli(["envoy-config", "--wirings", str(tmp_path), "--validate"]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(ec.WIRINGS) == sorted(p.name for p in (REPO / "envoy").glob("*.yaml"))
    for name in written:
        mine = (tmp_path / name).read_text(encoding="utf-8")
        assert mine == ec.wiring_text(name, str(tmp_path))
        assert _strip_comments(mine) == _strip_comments((REPO / "envoy" / name).read_text())


# --- real Envoy -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "opts",
    [
        EnvoyOptions(),
        EnvoyOptions(
            listen_host="127.0.0.1",
            listen_port=18888,
            admin_port=0,
            extproc_host="plugin.example",
            extproc_port=6000,
            message_timeout_s=0.25,
            max_request_bytes=64 * 1024 * 1024,
            upstream_connect_timeout_s=0.5,
        ),
        EnvoyOptions(
            fail_open=True,
            steering="override-host",
            endpoints=("10.0.0.1:8000", "10.0.0.2:8000", "[fd00::3]:8000"),
        ),
        EnvoyOptions(extproc_replicas=("10.0.0.1:50052", "10.0.0.2:50052", "[fd00::3]:50052")),
    ],
    ids=["defaults", "other-ports-dns-64MiB", "override-host", "plugin-replicas"],
)
def test_envoy_accepts_rendering(opts: EnvoyOptions, tmp_path: Path, envoy_binary: str) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(bootstrap_yaml(opts), encoding="utf-8")
    ec.validate_bootstrap(path)


def test_envoy_rejection_raises_with_envoys_message(tmp_path: Path, envoy_binary: str) -> None:
    path = tmp_path / "envoy.yaml"
    text = bootstrap_yaml(EnvoyOptions()).replace("BUFFERED", "BUFFERD")
    path.write_text(text, encoding="utf-8")
    with pytest.raises(RuntimeError, match="BUFFERD"):
        ec.validate_bootstrap(path)


def test_cli_out_writes_a_file_envoy_accepts(
    tmp_path: Path, envoy_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ec.MAX_MESSAGE_ENV, str(8 * 1024 * 1024))
    out = tmp_path / "boot.yaml"
    argv = ["envoy-config", "--out", str(out), "--listen-port", "18080", "--fail-open"]
    argv += ["--steering", "override-host", "--endpoints", "10.0.0.1:8000"]
    assert _run_cli([*argv, "--validate"]) == 0
    text = out.read_text(encoding="utf-8")
    assert text.startswith("# Generated by `hetero-gateway envoy-config")
    assert "--listen-port 18080" in text.splitlines()[0]
    boot = yaml.safe_load(text)
    assert boot["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] == (
        8 * 1024 * 1024
    )
    assert routing_filter(boot)["failure_mode_allow"] is True


# --- CLI without Envoy ----------------------------------------------------------------------------


def test_cli_prints_default_rendering(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ec.MAX_MESSAGE_ENV, raising=False)
    assert _run_cli(["envoy-config"]) == 0
    assert capsys.readouterr().out == bootstrap_yaml(EnvoyOptions())


def test_flag_beats_env_for_max_request_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ec.MAX_MESSAGE_ENV, "not-a-number")
    args = _parser().parse_args(["envoy-config", "--max-request-bytes", "1024"])
    assert ec.options_from_args(args).max_request_bytes == 1024


@pytest.mark.parametrize(
    "raw", ["lots", "0", "-5", "1.5"], ids=["word", "zero", "negative", "float"]
)
def test_bad_env_exits_naming_the_variable(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ec.MAX_MESSAGE_ENV, raw)
    with pytest.raises(SystemExit) as info:
        _run_cli(["envoy-config"])
    assert "AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES" in str(info.value.code)


def test_bad_flag_value_exits_with_message() -> None:
    with pytest.raises(SystemExit) as info:
        _run_cli(["envoy-config", "--listen-host", "localhost"])
    assert "listen_host" in str(info.value.code)


def test_override_host_picks_members_by_metadata_and_falls_back_to_round_robin() -> None:
    opts = EnvoyOptions(steering="override-host", endpoints=("10.0.0.1:8000", "10.0.0.2:8001"))
    boot = render_bootstrap(opts)
    names = [c["name"] for c in boot["static_resources"]["clusters"]]
    assert ec.ORIGINAL_DST_CLUSTER not in names
    cluster = _cluster(boot, ec.OVERRIDE_HOST_CLUSTER)
    assert cluster["type"] == "STATIC"
    members = [
        e["endpoint"]["address"]["socket_address"]
        for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert members == [
        {"address": "10.0.0.1", "port_value": 8000},
        {"address": "10.0.0.2", "port_value": 8001},
    ]
    (policy,) = cluster["load_balancing_policy"]["policies"]
    config = policy["typed_extension_config"]["typed_config"]
    # Only the plugin can set envoy.lb metadata: a client header cannot steer.
    assert config["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}
    ]
    (fallback,) = config["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["name"] == "envoy.load_balancing_policies.round_robin"
    route = bootstrap_hcm(boot)["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["cluster"] == ec.OVERRIDE_HOST_CLUSTER


def test_cli_override_host_flags_round_trip(tmp_path: Path, envoy_binary: str) -> None:
    out = tmp_path / "boot.yaml"
    argv = ["envoy-config", "--out", str(out), "--steering", "override-host", "--fail-open"]
    argv += ["--endpoints", "10.0.0.1:8000,10.0.0.2:8000", "--max-request-bytes", "4194304"]
    assert _run_cli([*argv, "--validate"]) == 0
    first = out.read_text(encoding="utf-8").splitlines()[0]
    assert "--steering override-host --endpoints 10.0.0.1:8000,10.0.0.2:8000" in first


def test_fail_open_with_original_dst_is_refused_saying_why() -> None:
    with pytest.raises(ValueError, match="target-pod header would send the request to any"):
        EnvoyOptions(fail_open=True)
    with pytest.raises(SystemExit, match="fail open with --steering override-host"):
        _run_cli(["envoy-config", "--fail-open"])


def test_the_header_count_limit_is_rendered_from_the_plugin_s_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Envoy's max_headers_count and the plugin's 431 check read one variable, so they agree."""
    monkeypatch.setenv("HETERO_GATEWAY_MAX_REQUEST_HEADERS", "120")
    out = tmp_path / "envoy.yaml"
    assert _run_cli(["envoy-config", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith(
        "# Generated by `HETERO_GATEWAY_MAX_REQUEST_HEADERS=120 hetero-gateway envoy-config"
    )
    hcm = bootstrap_hcm(yaml.safe_load(text))
    assert hcm["common_http_protocol_options"] == {"max_headers_count": 120}
    monkeypatch.setenv("HETERO_GATEWAY_MAX_REQUEST_HEADERS", "many")
    with pytest.raises(SystemExit, match="HETERO_GATEWAY_MAX_REQUEST_HEADERS"):
        _run_cli(["envoy-config"])


def test_only_the_override_host_wiring_retries_a_refused_connection() -> None:
    """override_host retries once on the fallback the plugin lists; ORIGINAL_DST would retry
    the same dead address, so it does not retry."""
    override = render_bootstrap(
        EnvoyOptions(steering="override-host", endpoints=("10.0.0.1:8000", "10.0.0.2:8000"))
    )
    original = render_bootstrap(EnvoyOptions())
    for boot, retries in ((override, True), (original, False)):
        routes = bootstrap_hcm(boot)["route_config"]["virtual_hosts"][0]["routes"]
        for route in routes[:-1]:  # the OpenAI paths; the last is the 404
            policy = route["route"].get("retry_policy")
            if retries:
                assert policy["num_retries"] == 1
                assert set(policy["retry_on"].split(",")) == {
                    "connect-failure",
                    "refused-stream",
                    "reset-before-request",
                }
            else:
                assert policy is None
