"""`instructions` on a variant that has no instruct block: refused, or dropped and reported.

Only VoiceDesign and CustomVoice (except 0.6B) prompts take an instruction; the talker's prompt
builder drops it for the others, as the official wrapper does. Dropping it silently would answer a
different request than the one sent, so the gateway refuses it (400 / INVALID_ARGUMENT naming
`instructions`) unless started with `--unsupported-instructions ignore`, for clients that always
send one: the request then runs without it and the response says what was ignored. The rule is
checked in the request's one pass (`qtts.request.vocabulary.check_request`); this module reports
its outcome.
"""

from __future__ import annotations

from .job import SynthesisJob

# HTTP response header (and gRPC initial metadata key) naming the request fields that were ignored.
IGNORED_FIELDS_HEADER = "x-tts-ignored-fields"


def ignored_fields_header(job: SynthesisJob) -> dict[str, str]:
    """The response header reporting what `job` ignored ({} when nothing was)."""
    return {IGNORED_FIELDS_HEADER: ",".join(job.ignored_fields)} if job.ignored_fields else {}
