"""Connection aging of the GPU stages' gRPC servers and the gateway's talker balancing flags."""

from __future__ import annotations

import pytest

from qtts.request.errors import InvalidArgument
from qtts.serving.grpc_server import connection_age_options
from services.code2wav.config import config_from_args as code2wav_config
from services.gateway.config import config_from_args as gateway_config
from services.talker.config import config_from_args as talker_config


def test_connection_age_options():
    assert connection_age_options(0, 330) == []
    assert connection_age_options(120, 330) == [
        ("grpc.max_connection_age_ms", 120_000),
        ("grpc.max_connection_age_grace_ms", 330_000),
    ]


@pytest.mark.parametrize("parse", [talker_config, code2wav_config])
def test_gpu_stages_age_connections_by_default_and_take_the_flags(parse):
    default = parse([])
    # Streams on an aged connection run to their end: the grace is longer than any stream.
    assert default.max_connection_age_s > 0 and default.max_connection_age_grace_s == 900
    given = parse(["--max-connection-age-s=60", "--max-connection-age-grace-s=400"])
    assert (given.max_connection_age_s, given.max_connection_age_grace_s) == (60, 400)
    assert parse(["--max-connection-age-s=0"]).max_connection_age_s == 0


@pytest.mark.parametrize("parse", [talker_config, code2wav_config])
def test_negative_connection_age_is_refused(parse):
    with pytest.raises((InvalidArgument, SystemExit)):
        parse(["--max-connection-age-s=-1"])


def test_gateway_talker_balancing_flags():
    assert (gateway_config([]).talker_balancing, gateway_config([]).talker_refresh_s) == ("pool", 5.0)
    c = gateway_config(["--talker-balancing=channel", "--talker-refresh-s=2"])
    assert (c.talker_balancing, c.talker_refresh_s) == ("channel", 2.0)
    for bad in (["--talker-balancing=random"], ["--talker-refresh-s=0"]):
        with pytest.raises(InvalidArgument):
            gateway_config(bad)
