"""The gateway's playback clock: slack and server-side underruns at the last hop."""

from prometheus_client import CollectorRegistry

from qtts.serving.metrics import GatewayMetrics
from services.gateway.playback import PlaybackClock


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sample(registry: CollectorRegistry, name: str) -> float:
    return registry.get_sample_value(name) or 0.0


def test_a_chunk_after_the_audio_before_it_ran_out_is_an_underrun():
    registry = CollectorRegistry()
    clock = FakeClock()
    pb = PlaybackClock(GatewayMetrics(registry), clock=clock)
    pb.handed_on(24000 * 32 // 100)  # first chunk, 320 ms: playback starts, nothing to judge
    assert sample(registry, "tts_gateway_deadline_slack_seconds_count") == 0
    clock.now += 0.30  # 20 ms of audio left
    pb.handed_on(24000 * 32 // 100)
    assert sample(registry, "tts_gateway_underruns_total") == 0
    clock.now += 0.70  # 640 ms delivered, 1.0 s played: 360 ms of silence
    pb.handed_on(24000)
    assert sample(registry, "tts_gateway_underruns_total") == 1
    assert sample(registry, "tts_gateway_deadline_slack_seconds_count") == 2
    assert registry.get_sample_value("tts_gateway_deadline_slack_seconds_bucket", {"le": "0.0"}) == 1


def test_speed_shortens_the_audio_a_chunk_plays_for():
    registry = CollectorRegistry()
    clock = FakeClock()
    pb = PlaybackClock(GatewayMetrics(registry), speed=2.0, clock=clock)
    pb.handed_on(24000)  # 1 s of talker audio plays for 0.5 s at speed 2
    clock.now += 0.6
    pb.handed_on(24000)
    assert sample(registry, "tts_gateway_underruns_total") == 1
