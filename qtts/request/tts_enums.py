"""tts.v1 enums <-> the task and finish-reason names the services use internally (one table,
shared by the gateway and the talker, like `qtts.request.sampling_pb` for the sampling fields)."""

from __future__ import annotations

from qtts.pb import tts_pb2
from qtts.request.vocabulary import Task

# TASK_TYPE_UNSPECIFIED maps to None: the model's default task.
TASK_FROM_PB: dict[int, str | None] = {
    tts_pb2.TASK_TYPE_UNSPECIFIED: None,
    tts_pb2.TASK_TYPE_VOICE_CLONE: Task.VOICE_CLONE.value,
    tts_pb2.TASK_TYPE_CUSTOM_VOICE: Task.CUSTOM_VOICE.value,
    tts_pb2.TASK_TYPE_VOICE_DESIGN: Task.VOICE_DESIGN.value,
}
TASK_TO_PB: dict[str, int] = {name: value for value, name in TASK_FROM_PB.items() if name is not None}

FINISH_TO_PB: dict[str, int] = {"stop": tts_pb2.FINISH_REASON_STOP, "length": tts_pb2.FINISH_REASON_LENGTH}
FINISH_FROM_PB: dict[int, str] = {value: name for name, value in FINISH_TO_PB.items()}
