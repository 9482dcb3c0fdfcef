"""`python -m qtts.serving.probe HOST:PORT [--tls-...]`: exit 0 when the server's overall grpc.health.v1
status is SERVING, 1 otherwise (the reason on stderr).

The kubelet's own gRPC probe speaks plaintext only; with TLS between the services the chart
probes through this command instead, with the pod's own certificate.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qtts.request.errors import TTSError
from qtts.serving.service_config import env_lookup
from qtts.serving.tls import TlsConfig, add_tls_flags, sync_channel, tls_from_args


def health_status(address: str, tls: TlsConfig | None = None, service: str = "", timeout: float = 1.0) -> str:
    """The grpc.health.v1 status name of `service` ("" = overall) at `address`, or "UNREACHABLE"."""
    with sync_channel(address, tls) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qtts.serving.probe", description=__doc__)
    p.add_argument("address", help="host:port of the gRPC server")
    p.add_argument("--service", default="", help="health service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds")
    add_tls_flags(p, env_lookup("probe"))
    ns = p.parse_args(argv)
    try:
        tls = tls_from_args(ns).validate(serves=False)
    except TTSError as exc:
        print(f"probe: {exc.message}", file=sys.stderr)
        return 2
    status = health_status(ns.address, tls, ns.service, ns.timeout)
    if status != "SERVING":
        print(f"probe: {ns.address} is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
