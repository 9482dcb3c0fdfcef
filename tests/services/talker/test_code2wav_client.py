"""How the talker reads a failed Decode call: the replica gone, or a verdict on the stream."""

from __future__ import annotations

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from qtts.request.errors import Unavailable
from services.talker.code2wav_client import CLIENT_CORE_FAILURE, _error


def rpc_error(code: grpc.StatusCode, details: str) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(), details)


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.UNAVAILABLE, "Socket closed"),
        (grpc.StatusCode.CANCELLED, "server shutting down"),
        # grpc.aio's own INTERNAL for a call that died under the client (the replica stopped
        # mid-stream): seen in about 1 of 13 runs of the replica-goes-away test.
        (grpc.StatusCode.INTERNAL, CLIENT_CORE_FAILURE),
    ],
)
def test_a_replica_that_went_away_is_unavailable_and_down(code, details):
    failed = _error("10.0.0.1:50053", rpc_error(code, details))
    assert failed.replica_down and isinstance(failed.error, Unavailable)
    assert "code2wav replica 10.0.0.1:50053 went away" in failed.error.message


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.INTERNAL, "internal error"),  # what a replica's own failure reads as
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "decoder state bound reached"),
    ],
)
def test_a_status_the_replica_sent_is_kept_and_the_replica_stays_up(code, details):
    failed = _error("10.0.0.1:50053", rpc_error(code, details))
    assert not failed.replica_down and not isinstance(failed.error, Unavailable)
    assert details in failed.error.message
