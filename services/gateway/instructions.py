"""`instructions` on a variant that has no instruct block: refused, or dropped and reported.

Only VoiceDesign and CustomVoice (except 0.6B) prompts take an instruction; the talker's prompt
builder drops it for the others, as the official wrapper does. Dropping it silently would answer a
different request than the one sent, so the gateway refuses it (400 / INVALID_ARGUMENT naming
`instructions`) unless started with `--unsupported-instructions ignore`, for clients that always
send one: the request then runs without it and the response says what was ignored.
"""

from __future__ import annotations

from dataclasses import replace

from qtts.request.errors import InvalidArgument
from qtts.request.model_variants import supports_instructions

from .job import ModelCatalog, SynthesisJob

# HTTP response header (and gRPC initial metadata key) naming the request fields that were ignored.
IGNORED_FIELDS_HEADER = "x-tts-ignored-fields"


def apply_instructions_policy(
    job: SynthesisJob, catalog: ModelCatalog, policy: str = "reject"
) -> SynthesisJob:
    """`job` as it will run: unchanged where its variant honours instructions (or none were sent),
    else refused (`policy` "reject") or without them, with `instructions` in `ignored_fields`."""
    if not job.instructions or supports_instructions(catalog.model_type, catalog.model_size):
        return job
    if policy == "ignore":
        return replace(job, instructions="", ignored_fields=(*job.ignored_fields, "instructions"))
    size = f" {catalog.model_size}" if catalog.model_size else ""
    raise InvalidArgument(
        f"instructions are not supported by {catalog.name} ({catalog.model_type}{size}): only VoiceDesign "
        "and 1.7B CustomVoice models take them; leave the field out (a gateway started with "
        "--unsupported-instructions ignore drops it and reports it in the x-tts-ignored-fields header)",
        param="instructions",
    )


def ignored_fields_header(job: SynthesisJob) -> dict[str, str]:
    """The response header reporting what `job` ignored ({} when nothing was)."""
    return {IGNORED_FIELDS_HEADER: ",".join(job.ignored_fields)} if job.ignored_fields else {}
