"""What `pip install` leaves: one owner per installed file, and an OTLP exporter that imports.

The ext_proc stubs used to come from `xds-protos`, which also installs old copies of
OpenTelemetry's protos at `opentelemetry/proto/`, over the real ones when pip happens to install
it second; the exporter then fails to import (`cannot import name 'InstrumentationScope'`). The
stubs are now built from `proto/` into `hetero_gateway_protos` (setup.py); these tests catch any
distribution that writes over another's files again, and import the exporter the way a user of
the `otel` extra does, in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from importlib.metadata import distributions

import pytest
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2 as pb

pytestmark = pytest.mark.component


def _owners() -> dict[str, set[str]]:
    owners: dict[str, set[str]] = defaultdict(set)
    for dist in distributions():
        for path in dist.files or ():
            name = path.as_posix()
            if "__pycache__" in name or ".dist-info/" in name:
                continue
            owners[name].add(dist.metadata["Name"])
    return owners


def test_no_two_installed_distributions_write_the_same_file() -> None:
    shared = {path: sorted(names) for path, names in _owners().items() if len(names) > 1}
    assert shared == {}, f"files installed by more than one distribution: {shared}"


def test_opentelemetrys_protos_come_from_opentelemetry_proto_alone() -> None:
    owners = _owners()
    otel = {
        path: names for path, names in owners.items() if path.startswith("opentelemetry/proto/")
    }
    assert otel, "opentelemetry-proto is not installed (the test extra includes the otel extra)"
    assert {name for names in otel.values() for name in names} == {"opentelemetry-proto"}
    assert not any(path.startswith("envoy/service/") for path in owners), (
        "Envoy's protos installed at their own import path: xds-protos is back"
    )


def test_the_otlp_exporter_imports_in_a_fresh_interpreter() -> None:
    code = (
        "from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter\n"
        "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope\n"
        "OTLPSpanExporter(endpoint='127.0.0.1:4317', insecure=True).shutdown()\n"
        "print(InstrumentationScope(name='hetero-gateway').name)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "hetero-gateway"


def test_the_stubs_carry_envoys_names_so_envoy_finds_the_service() -> None:
    # Envoy calls `/envoy.service.ext_proc.v3.ExternalProcessor/Process`: the proto package, not
    # the Python one, names it.
    service = pb.DESCRIPTOR.services_by_name["ExternalProcessor"]
    assert service.full_name == "envoy.service.ext_proc.v3.ExternalProcessor"
    method = service.methods_by_name["Process"]
    assert (method.client_streaming, method.server_streaming) == (True, True)
    assert (
        pb.ProcessingRequest.DESCRIPTOR.full_name == "envoy.service.ext_proc.v3.ProcessingRequest"
    )
