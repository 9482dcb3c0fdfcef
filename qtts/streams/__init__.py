"""What passes between the stages of one stream: the chunk plan code2wav decodes by and the
talker sends whole chunks of (chunk_plan), the events of a code2wav Decode stream (decode_events),
the consistent-hash ring that pins a stream to one code2wav replica (hash_ring) and the content
key the talker looks voice prompts up by in speaker_cache (voice_key)."""
