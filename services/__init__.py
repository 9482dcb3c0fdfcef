"""The four services of the stack, one package each: gateway, talker, code2wav, speaker_cache."""
