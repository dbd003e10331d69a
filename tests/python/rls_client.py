"""An independent gRPC client of Envoy's rate limit service: grpcio, with
stubs generated at run time by grpcio-tools from proto/ (Envoy's rls.proto,
cut down), replays a transcript against Tollgate and checks every field of
every answer byte for byte. Run by tests/single_node/test_python_client.rs:

    python3 tests/python/rls_client.py 127.0.0.1:PORT

The server serves tests/single_node/test_envoy.rs's rules on a frozen clock.
Prints one JSON line ({"checked": N}); exits 1 at the first difference.
"""

import importlib.resources
import json
import os
import sys
import tempfile

import grpc
from grpc_tools import protoc

HERE = os.path.dirname(os.path.abspath(__file__))


def generate_stubs(out):
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    status = protoc.main(
        [
            "protoc",
            f"-I{HERE}/proto",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            "envoy/service/ratelimit/v3/rls.proto",
            "envoy/extensions/common/ratelimit/v3/ratelimit.proto",
        ]
    )
    if status != 0:
        sys.exit(f"grpc_tools.protoc failed with {status}")
    sys.path.insert(0, out)


def main():
    target = sys.argv[1]
    generate_stubs(tempfile.mkdtemp(prefix="rls-stubs-"))
    from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
    from google.protobuf import duration_pb2, text_format, wrappers_pb2

    Response = rls_pb2.RateLimitResponse
    Limit = Response.RateLimit

    def descriptor(entries, hits_addend=None):
        d = ratelimit_pb2.RateLimitDescriptor(
            entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries]
        )
        if hits_addend is not None:
            d.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=hits_addend))
        return d

    def request(*descriptors, domain="edge", hits_addend=0):
        return rls_pb2.RateLimitRequest(
            domain=domain, descriptors=list(descriptors), hits_addend=hits_addend
        )

    def status(code, limit=None, remaining=0, reset=None):
        s = Response.DescriptorStatus(code=code, limit_remaining=remaining)
        if limit is not None:
            requests, unit, name = limit
            s.current_limit.CopyFrom(Limit(requests_per_unit=requests, unit=unit, name=name))
        if reset is not None:
            s.duration_until_reset.CopyFrom(duration_pb2.Duration(seconds=reset))
        return s

    def response(code, *statuses):
        return Response(overall_code=code, statuses=list(statuses))

    login = [("path", "/login"), ("ip", "10.2.0.1")]
    login_limit = (3, Limit.MINUTE, "login")
    upload_limit = (2, Limit.UNKNOWN, "")
    transcript = [
        (request(descriptor(login)), response(Response.OK, status(Response.OK, login_limit, 2, 60))),
        (
            request(descriptor(login), hits_addend=2),
            response(Response.OK, status(Response.OK, login_limit, 0, 60)),
        ),
        (
            request(descriptor(login)),
            response(Response.OVER_LIMIT, status(Response.OVER_LIMIT, login_limit, 0, 60)),
        ),
        (
            request(
                descriptor([("path", "/upload")]),
                descriptor([("path", "/elsewhere")]),
                descriptor([("path", "/open")]),
                descriptor([("path", "/closed")]),
            ),
            response(
                Response.OVER_LIMIT,
                status(Response.OK, upload_limit, 1, 30),
                status(Response.OK, (100, Limit.HOUR, ""), 99, 3600),
                status(Response.OK, None, 5, None),
                status(Response.OVER_LIMIT, (0, Limit.UNKNOWN, ""), 0, None),
            ),
        ),
        (
            request(descriptor([("path", "/upload")], hits_addend=0)),
            response(Response.OK, status(Response.OK, upload_limit, 0, 30)),
        ),
        (
            request(descriptor([("path", "/upload")], hits_addend=1)),
            response(Response.OK, status(Response.OK, upload_limit, 0, 30)),
        ),
        (
            request(descriptor([("path", "/upload")])),
            response(Response.OVER_LIMIT, status(Response.OVER_LIMIT, upload_limit, 0, 30)),
        ),
        (request(descriptor(login), domain=""), grpc.StatusCode.INVALID_ARGUMENT),
        (request(), grpc.StatusCode.INVALID_ARGUMENT),
        (request(descriptor([])), grpc.StatusCode.INVALID_ARGUMENT),
        (request(descriptor(login), hits_addend=2**32 - 1), grpc.StatusCode.INVALID_ARGUMENT),
    ]

    checked = 0
    with grpc.insecure_channel(target) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        for number, (sent, expected) in enumerate(transcript, 1):
            try:
                got = stub.ShouldRateLimit(sent, timeout=10)
            except grpc.RpcError as error:
                if error.code() != expected:
                    sys.exit(f"request {number}: {error.code()} {error.details()!r}, expected {expected}")
                checked += 1
                continue
            if isinstance(expected, grpc.StatusCode):
                sys.exit(f"request {number}: answered {text_format.MessageToString(got)}, expected {expected}")
            if got.SerializeToString(deterministic=True) != expected.SerializeToString(deterministic=True):
                sys.exit(
                    f"request {number}:\n{text_format.MessageToString(sent)}\ngot:\n"
                    f"{text_format.MessageToString(got)}\nexpected:\n{text_format.MessageToString(expected)}"
                )
            checked += 1
    print(json.dumps({"checked": checked}))


if __name__ == "__main__":
    main()
