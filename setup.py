"""Generates the Envoy ext_proc stubs from `proto/` when the package is built.

The stubs land in the wheel as `hetero_gateway_protos`, built with the protoc that grpcio-tools
ships (pinned in pyproject.toml's build requirements, so the generated code always asks for the
same protobuf runtime). They are built rather than taken from `xds-protos`, which also installs
old copies of OpenTelemetry's protos at `opentelemetry.proto` over the real ones and so breaks
the OTLP exporter (proto/README.md). Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTO_ROOT = Path(__file__).resolve().parent / "proto"
PACKAGE = "hetero_gateway_protos"


def compile_protos(out: Path) -> list[Path]:
    """Runs protoc over every `.proto` under proto/PACKAGE into `out`; returns the files made."""
    from importlib.resources import files

    from grpc_tools import protoc

    well_known = files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    sources = sorted(
        p.relative_to(PROTO_ROOT).as_posix() for p in (PROTO_ROOT / PACKAGE).rglob("*.proto")
    )
    services = [s for s in sources if "\nservice " in (PROTO_ROOT / s).read_text()]
    out.mkdir(parents=True, exist_ok=True)
    paths = [f"--proto_path={PROTO_ROOT}", f"--proto_path={well_known}"]
    for args in (
        [f"--python_out={out}", f"--pyi_out={out}", *sources],
        [f"--grpc_python_out={out}", *services],  # the service stubs, where there is a service
    ):
        if protoc.main(["grpc_tools.protoc", *paths, *args]) != 0:
            raise SystemExit(f"protoc failed on {PROTO_ROOT / PACKAGE}")
    made = [p for p in (out / PACKAGE).rglob("*") if p.is_file()]
    # Regular packages (not namespace ones), and typed: mypy reads the .pyi stubs protoc wrote.
    for folder in [out / PACKAGE, *(p for p in (out / PACKAGE).rglob("*") if p.is_dir())]:
        init = folder / "__init__.py"
        if not init.exists():
            init.write_text("")
            made.append(init)
    marker = out / PACKAGE / "py.typed"
    marker.write_text("")
    made.append(marker)
    return made


class BuildPyWithProtos(build_py):
    """`build_py`, then the stubs into the same build folder, so the wheel carries them. An
    editable install (`pip install -e .`) builds them in place, beside the .proto files, where
    its import hook finds the package (setuptools' `SubCommand` protocol asks for that)."""

    def run(self) -> None:
        super().run()
        self._protos = compile_protos(PROTO_ROOT if self.editable_mode else Path(self.build_lib))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), *map(str, getattr(self, "_protos", []))]


setup(cmdclass={"build_py": BuildPyWithProtos})
