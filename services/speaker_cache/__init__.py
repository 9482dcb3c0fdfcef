"""speaker_cache service: voice prompts by content key and named voices, in Redis or an in-process LRU."""
