"""talker flags: env fallbacks, comma-separated replicas, clear errors for unusable values."""

from __future__ import annotations

import pytest

from qtts.request.errors import InvalidArgument
from services.talker.config import TalkerConfig, config_from_args


def test_flags_and_env_fallbacks(monkeypatch):
    monkeypatch.setenv("TTS_TALKER_MAX_BATCH", "12")
    cfg = config_from_args(["--code2wav", "10.0.0.1:50053, 10.0.0.2:50053", "--credit-window-frames", "5"])
    assert cfg.code2wav == ("10.0.0.1:50053", "10.0.0.2:50053")
    assert (cfg.max_batch, cfg.credit_window_frames, cfg.port) == (12, 5, 50052)
    assert cfg.model_path.endswith(".tiny/qwen3-tts-tiny-base")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--code2wav", "nohostport"], "host:port"),
        (["--max-batch", "0"], "--max-batch"),
        (["--credit-window-frames", "0"], "--credit-window-frames"),
        (["--port", "70000"], "--port"),
        (["--max-prefill-tokens", "0"], "--max-prefill-tokens"),
        (["--decode-kernels", "cuda"], "--decode-kernels"),
        (["--sample-kernel", "sort"], "--sample-kernel"),
        (["--gpu-others-gib", "-2"], "--gpu-others-gib"),
    ],
)
def test_unusable_flags_exit_with_a_clear_message(flags, message, capsys):
    with pytest.raises(SystemExit):
        config_from_args(flags)
    assert message in capsys.readouterr().err


def test_validate_rejects_an_empty_replica_list():
    with pytest.raises(InvalidArgument, match="at least one"):
        TalkerConfig(code2wav=()).validate()


def test_engine_flags_reach_the_graph_engine_config(monkeypatch):
    from qtts.engine.model_runner import DECODE_KERNELS, SAMPLE_KERNELS
    from services.talker import config as config_mod

    assert config_mod.DECODE_KERNELS == DECODE_KERNELS
    assert config_mod.SAMPLE_KERNELS == SAMPLE_KERNELS
    monkeypatch.setenv("TTS_TALKER_DECODE_KERNELS", "torch")
    cfg = config_from_args(["--max-prefill-tokens", "1024", "--sample-kernel", "torch"])
    assert (cfg.decode_kernels, cfg.max_prefill_tokens, cfg.sample_kernel) == ("torch", 1024, "torch")
    assert config_from_args([]).max_prefill_tokens == 2048


def test_the_decoder_shares_the_gpu_only_when_told_and_the_launcher_tells_on_one_gpu():
    import dataclasses

    from services.launcher import StackConfig, talker_spec

    assert not config_from_args([]).decoder_shares_gpu  # deployments decode on other GPUs
    assert config_from_args(["--decoder-shares-gpu"]).decoder_shares_gpu

    def told(device: str, code2wav_devices: tuple[str, ...] = ()) -> bool:
        cfg = dataclasses.replace(StackConfig(), device=device, code2wav_devices=code2wav_devices)
        return "--decoder-shares-gpu" in talker_spec(cfg, "m").args

    assert told("cuda") and told("cuda:0", ("cuda",)) and told("cuda:1", ("cuda:0", "cuda:1"))
    assert not told("cpu") and not told("cuda:0", ("cuda:1", "cuda:2"))


def test_the_kv_slots_leave_code2wav_its_memory_when_it_shares_the_gpu(monkeypatch):
    """--gpu-others-gib -1 (the default): nothing alone, 24 GiB with code2wav on the same GPU (an
    H100 stack ran code2wav out of memory mid-capture); the graph engine's runner gets it."""
    from services.talker import model_setup

    assert config_from_args([]).gpu_others_bytes == 0
    assert config_from_args(["--decoder-shares-gpu"]).gpu_others_bytes == 24 << 30
    assert config_from_args(["--decoder-shares-gpu", "--gpu-others-gib", "0"]).gpu_others_bytes == 0
    seen = {}

    class Engine:
        def __init__(self, bundle, max_batch, config):
            seen["others"] = config.runner.others_bytes

    import qtts.engine

    monkeypatch.setattr(qtts.engine, "GraphEngine", Engine)
    cfg = config_from_args(["--engine", "graph", "--gpu-others-gib", "6.5"])
    model_setup.generator_factory_for(cfg)(None, 8)
    assert seen["others"] == int(6.5 * (1 << 30))


def test_the_kv_slots_leave_the_aligner_its_memory_when_it_shares_the_gpu():
    """An aligner on the talker's GPU adds 14 GiB to what --gpu-others-gib -1 leaves (an H100
    stack with --aligner ran the aligner out of memory while it captured its graphs); the
    launcher says so when the aligner's --device is the talker's GPU, not when it is the CPU or
    another GPU."""
    import dataclasses

    from services.launcher import StackConfig, talker_spec

    assert config_from_args(["--aligner-shares-gpu"]).gpu_others_bytes == 14 << 30
    both = config_from_args(["--decoder-shares-gpu", "--aligner-shares-gpu"])
    assert both.gpu_others_bytes == 38 << 30
    told_others = config_from_args(["--decoder-shares-gpu", "--aligner-shares-gpu", "--gpu-others-gib", "30"])
    assert told_others.gpu_others_bytes == 30 << 30

    def told(device: str, aligner_args: tuple[str, ...], aligner_port: int = 50050) -> bool:
        cfg = dataclasses.replace(
            StackConfig(), device=device, aligner_port=aligner_port, extra_args={"aligner": aligner_args}
        )
        return "--aligner-shares-gpu" in talker_spec(cfg, "m").args

    assert told("cuda", ("--device", "cuda")) and told("cuda:0", ("--device=cuda",))
    assert told("cuda:1", ("--device", "cuda:0", "--device", "cuda:1"))  # the last one counts
    assert not told("cuda", ())  # the aligner's default device is the CPU
    assert not told("cuda", ("--device", "cpu")) and not told("cuda:0", ("--device", "cuda:1"))
    assert not told("cpu", ("--device", "cpu")) and not told("cuda", ("--device", "cuda"), aligner_port=0)
