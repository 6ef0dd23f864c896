"""`hetero-gateway serve` and `envoy-config` through the real entry point, `plugin.cli.main`.

A bad configuration must stop `serve` before anything starts, with exit status 2 and one message
naming the variable or file (a YAML error adds its location on further lines). For the good path
the blocking `run_until_signal` is replaced by one that starts the real gateway, waits for
discovery, records what it saw and stops it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugin.adapters.serve import Gateway
from plugin.cli import main
from plugin.config import ENV_VARS, Var, flag_vars
from plugin.errors import ConfigError
from tests.helpers import ObserveServe

pytestmark = pytest.mark.component

PREFIX = "hetero-gateway: configuration error: "


def _pods_doc(*names: str) -> dict[str, Any]:
    pods = [{"name": n, "address": "127.0.0.1", "port": 18000 + i} for i, n in enumerate(names)]
    return {"models": {"m": {"pods": pods}}}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's variables must not leak in; and uvloop stays out of the test process."""
    for var in ENV_VARS:
        monkeypatch.delenv(var.name, raising=False)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` -> ImportError


@dataclass
class Started:
    settings: Any
    host: str
    grpc_port: int
    http_port: int
    pod_keys: list[str]


@pytest.fixture
def started(observe_serve: ObserveServe) -> list[Started]:
    """`serve` starts its real gateway, which is observed once its pods are loaded, then stopped."""

    async def observe(gateway: Gateway) -> Started:
        keys = sorted(p.key for p in gateway.pool.pods())
        return Started(gateway.settings, gateway.host, gateway.grpc_port, gateway.http_port, keys)

    return observe_serve(observe)


@pytest.fixture
def good_pods(tmp_path: Path) -> Path:
    path = tmp_path / "good.yaml"
    path.write_text(yaml.safe_dump(_pods_doc("a", "b")), encoding="utf-8")
    return path


def _serve_args(pods: Path | None = None) -> list[str]:
    argv = ["serve", "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0"]
    return argv if pods is None else [*argv, "--pods", str(pods)]


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    # One message (a YAML error may add its location on the following lines).
    assert captured.err.startswith(PREFIX), captured.err
    assert captured.err.count("hetero-gateway:") == 1
    return captured.err.strip()


# --- bad configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE", "2"),
        ("AIBRIX_LOAD_BALANCE_KV_CRITICAL_FREE", "-0.1"),
        ("AIBRIX_LOAD_BALANCE_QUEUED_WEIGHT", "-1"),
        ("AIBRIX_LOAD_BALANCE_KV_PRESSURE_ALPHA", "lots"),
        ("ROUTING_ALGORITHM", "fastest"),
        ("AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS", "0"),
        ("AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES", "4MiB"),
        ("HETERO_GATEWAY_SCRAPE_TIMEOUT_MS", "-5"),
        ("HETERO_GATEWAY_METRICS_MAX_AGE_INTERVALS", "1.5"),
        ("HETERO_GATEWAY_CAPACITY_WINDOW_S", "inf"),
        ("HETERO_GATEWAY_CAPACITY_TAU_S", "nan"),
        ("HETERO_GATEWAY_LOG_LEVEL", "LOUD"),
        ("HETERO_GATEWAY_WORKERS", "2"),  # without REDIS_HOST: the workers could share nothing
        ("HETERO_GATEWAY_WORKERS", "0"),
    ],
    ids=[
        "kv-critical-above-1",
        "kv-critical-negative",
        "queued-weight-negative",
        "alpha-word",
        "unknown-strategy",
        "refresh-zero",
        "max-message-units",
        "scrape-timeout-negative",
        "max-age-float",
        "window-inf",
        "tau-nan",
        "log-level",
        "workers-without-redis",
        "no-workers",
    ],
)
def test_bad_variable_exits_2_naming_it(
    var: str,
    value: str,
    good_pods: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    started: list[Started],
) -> None:
    monkeypatch.setenv(var, value)
    assert main(_serve_args(good_pods)) == 2
    assert var in _error_line(capsys)
    assert started == []  # nothing was started


def test_no_pods_file_exits_2_naming_the_variable(
    capsys: pytest.CaptureFixture[str], started: list[Started]
) -> None:
    assert main(_serve_args()) == 2
    line = _error_line(capsys)
    assert "HETERO_GATEWAY_PODS_FILE" in line
    assert "--pods" in line
    assert started == []


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "cannot read pods file"),
        ("models: [unclosed\n", "is not valid YAML"),
        (yaml.safe_dump({"models": {"m": {"pods": [{"name": "a", "port": 1}]}}}), ".address"),
        (yaml.safe_dump(_pods_doc("a", "a")), "listed twice"),
        ("just a string\n", "'models' mapping"),
    ],
    ids=["missing", "bad-yaml", "no-address", "duplicate", "not-a-mapping"],
)
@pytest.mark.parametrize("via", ["flag", "env"], ids=["flag", "env"])
def test_invalid_pods_file_exits_2_naming_the_file(
    content: str | None,
    fragment: str,
    via: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    started: list[Started],
) -> None:
    path = tmp_path / "pods.yaml"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    if via == "env":
        monkeypatch.setenv("HETERO_GATEWAY_PODS_FILE", str(path))
        argv = _serve_args()
    else:
        argv = _serve_args(path)
    assert main(argv) == 2
    line = _error_line(capsys)
    assert str(path) in line
    assert fragment in line
    assert started == []


def test_bad_flag_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], started: list[Started]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--grpc-port", "not-a-number"])
    assert info.value.code == 2  # argparse's usage error, before any configuration is read
    assert "--grpc-port" in capsys.readouterr().err
    assert started == []


def test_config_error_from_run_maps_to_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # main maps a ConfigError raised anywhere in a command to status 2 with its message.
    def boom(_: Any) -> int:
        raise ConfigError("SOME_VAR is wrong")

    monkeypatch.setattr("plugin.adapters.serve_cli.run", boom)
    assert main(["serve"]) == 2
    assert _error_line(capsys) == PREFIX + "SOME_VAR is wrong"


# --- good configuration -------------------------------------------------------------------------


def test_serve_starts_with_flags_overriding_env(
    good_pods: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    started: list[Started],
) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("models: [unclosed\n", encoding="utf-8")
    monkeypatch.setenv("HETERO_GATEWAY_PODS_FILE", str(broken))  # --pods wins over it
    monkeypatch.setenv("HETERO_GATEWAY_GRPC_PORT", "1")  # --grpc-port 0 wins over it
    monkeypatch.setenv("ROUTING_ALGORITHM", "least-request")
    monkeypatch.setenv("AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS", "30000")

    assert main(_serve_args(good_pods)) == 0

    (run,) = started
    assert run.host == "127.0.0.1"
    assert run.settings.pods_file == str(good_pods)
    assert (run.settings.grpc_port, run.settings.http_port) == (0, 0)
    assert run.grpc_port > 0 and run.http_port > 0  # the OS chose them
    assert run.settings.default_strategy == "least-request"
    assert run.settings.metric_refresh_interval_s == 30.0
    assert run.pod_keys == ["default/a", "default/b"]


def test_largest_max_message_size_envoy_config_accepts_is_usable_by_serve(
    good_pods: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    started: list[Started],
) -> None:
    # envoy-config accepts up to 2**31 - 1 for the same variable; serve must run with it (the
    # gRPC receive limit adds room for the envelope without overflowing int32).
    monkeypatch.setenv("AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES", str(2**31 - 1))
    assert main(_serve_args(good_pods)) == 0
    assert len(started) == 1
    assert started[0].settings.max_message_bytes == 2**31 - 1


@pytest.mark.parametrize(
    ("flag", "value", "variable"),
    [
        ("--grpc-port", "70000", "HETERO_GATEWAY_GRPC_PORT"),
        ("--http-port", "-1", "HETERO_GATEWAY_HTTP_PORT"),
    ],
)
def test_a_bad_flag_value_is_refused_like_its_variable(
    flag: str,
    value: str,
    variable: str,
    good_pods: Path,
    capsys: pytest.CaptureFixture[str],
    started: list[Started],
) -> None:
    assert main([*_serve_args(good_pods), flag, value]) == 2
    assert variable in _error_line(capsys)
    assert not started


def test_a_flag_replaces_its_variable_bad_or_not(
    good_pods: Path, monkeypatch: pytest.MonkeyPatch, started: list[Started]
) -> None:
    monkeypatch.setenv("HETERO_GATEWAY_GRPC_PORT", "70000")  # overridden by --grpc-port 0
    assert main(_serve_args(good_pods)) == 0
    assert started[0].settings.grpc_port == 0


def test_envoy_config_ignores_an_unrelated_bad_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REDIS_HOST", "redis:6379")  # wrong, but envoy-config does not use it
    assert main(["envoy-config"]) == 0
    assert "ORIGINAL_DST" in capsys.readouterr().out


# --- envoy-config -------------------------------------------------------------------------------


def test_envoy_config_prints_bootstrap_steered_by_target_pod(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["envoy-config", "--extproc-port", "50099"]) == 0
    out = capsys.readouterr().out
    assert "target-pod" in out
    boot = yaml.safe_load(out)
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    original_dst = next(c for c in clusters.values() if c["type"] == "ORIGINAL_DST")
    assert original_dst["original_dst_lb_config"]["http_header_name"] == "target-pod"
    ports = [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for c in clusters.values()
        if "load_assignment" in c
        for group in c["load_assignment"]["endpoints"]
        for e in group["lb_endpoints"]
    ]
    assert 50099 in ports


def test_envoy_config_reads_max_message_size_from_env(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES", str(8 * 1024 * 1024))
    assert main(["envoy-config"]) == 0
    boot = yaml.safe_load(capsys.readouterr().out)
    listener = boot["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == 8 * 1024 * 1024


# --- flags declared with their variables --------------------------------------------------------


def _squeezed(text: str) -> str:
    """Without any whitespace: argparse wraps help lines (at spaces and after hyphens)."""
    return "".join(text.split())


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


FLAG_VARS = [v for v in ENV_VARS if v.flag is not None]


def test_the_flags_are_the_declared_ones() -> None:
    flags = {str(v.flag): v.name for v in FLAG_VARS}
    assert flags == {
        "serve --pods": "HETERO_GATEWAY_PODS_FILE",
        "serve --discovery": "HETERO_GATEWAY_DISCOVERY",
        "serve --grpc-port": "HETERO_GATEWAY_GRPC_PORT",
        "serve --http-port": "HETERO_GATEWAY_HTTP_PORT",
        "serve --workers": "HETERO_GATEWAY_WORKERS",
        "envoy-config --max-request-bytes": "AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES",
        "optimizer --port": "HETERO_GATEWAY_OPTIMIZER_PORT",
    }
    assert [v.name for v in flag_vars("serve")] == [
        v.name for v in FLAG_VARS if v.flag is not None and v.flag.command == "serve"
    ]


@pytest.mark.parametrize("var", FLAG_VARS, ids=lambda v: str(v.flag))
def test_a_flags_help_shows_its_declared_doc_and_default(
    var: Var[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert var.flag is not None
    out = _squeezed(_help(var.flag.command, capsys))
    help_text = var.flag_help()
    assert _squeezed(help_text) in out
    # The help is the declaration's: its doc (Markdown quotes dropped), variable and default.
    assert _squeezed(var.doc.replace("`", "").rstrip(".")) in _squeezed(help_text)
    assert f"${var.name}" in help_text
    default = var.default_text.strip("()")
    assert help_text.endswith(f", else {default})")
    assert _squeezed(f"{var.flag.option} ") in out


def test_serve_help_defaults_come_from_the_declarations(capsys: pytest.CaptureFixture[str]) -> None:
    out = _squeezed(_help("serve", capsys))
    for fragment in (
        "$HETERO_GATEWAY_GRPC_PORT,else50052)",
        "$HETERO_GATEWAY_HTTP_PORT,else8080)",
        "$HETERO_GATEWAY_DISCOVERY,elsefile)",
        "$HETERO_GATEWAY_PODS_FILE,elsenone)",
        "{file,kubernetes}",  # --discovery's choices are the variable's
    ):
        assert fragment in out
    envoy = _squeezed(_help("envoy-config", capsys))
    assert "$AIBRIX_GRPC_MAX_MESSAGE_SIZE_BYTES,else4194304)" in envoy
    assert "--max-request-bytesBYTES" in envoy


def test_discovery_flag_beats_its_variable(
    good_pods: Path, monkeypatch: pytest.MonkeyPatch, started: list[Started]
) -> None:
    monkeypatch.setenv("HETERO_GATEWAY_DISCOVERY", "consul")  # bad, but --discovery wins
    assert main([*_serve_args(good_pods), "--discovery", "file"]) == 0
    assert started[0].settings.discovery == "file"


def test_a_discovery_flag_outside_the_choices_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], started: list[Started]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--discovery", "consul"])
    assert info.value.code == 2
    assert "--discovery" in capsys.readouterr().err
    assert started == []


@pytest.mark.parametrize(
    ("flag", "var"),
    [("--http-port", "HETERO_GATEWAY_HTTP_PORT"), ("--grpc-port", "HETERO_GATEWAY_GRPC_PORT")],
)
def test_a_busy_port_is_one_line_naming_it_and_what_sets_it(
    flag: str, var: str, good_pods: Path
) -> None:
    """A port another process listens on stops `serve` with one line and exit 2, as every other
    start-up error does (it was a 30-line traceback for the HTTP port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = _serve_args(good_pods)
        argv[argv.index(flag) + 1] = str(port)
        done = subprocess.run(
            [sys.executable, "-m", "plugin", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    # Besides the log's own lines (gRPC's core logs the failed bind too): one error line.
    errors = [line for line in done.stderr.splitlines() if line.startswith("hetero-gateway:")]
    assert len(errors) == 1 and errors[0].startswith(PREFIX), done.stderr
    assert str(port) in errors[0] and var in errors[0] and f"serve {flag}" in errors[0]
