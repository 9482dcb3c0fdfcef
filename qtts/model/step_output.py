"""What one generator step hands back per stream (pure Python, no torch): `StepOutput` and the
finish reason of a row whose sampling broke. Shared by the eager generator and the GraphEngine's
slot scheduler, which decides finishing without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The finish reason of a row whose sampling broke (non-finite scores: a sampling setting far
# outside the API's ranges, or a broken prompt); only that row ends, its batch goes on.
SAMPLING_FAILED = "sampling_failed"


@dataclass
class StepOutput:
    request_id: str
    # The frame's 16 codes on the CPU, None on the EOS step: a LongTensor[16] from EagerGenerator, an
    # int16 ndarray[16] (a row of the step's one host array) from the GraphEngine.
    codes: Any
    finished: bool
    finish_reason: str | None = None  # None | "stop" | "length" | "frame_cap" | SAMPLING_FAILED
