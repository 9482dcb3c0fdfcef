"""code2wav GPU decode engine: batched stateful incremental decoding in a static slot pool.

`slot_decoder.SlotDecoder` offers the operations of `qtts.model.IncrementalDecoder` (`start`,
`decode`, `decode_batch`, `free`) on top of three parts:

- `slots.SlotPool`: every stream's decoder history in preallocated static-shape tensors (the hard
  bound on live streams);
- `batcher.BatchPlanner`: pure-Python planning of ready chunks into (batch bucket, chunk frames)
  steps, outputs mapped back by stream id;
- `runner.StepRunner`: the static-shape step itself, CUDA graphs per captured shape, eager fallback,
  fp32 / TF32 / bf16; the step is `frame_stage.FrameStage` (RVQ, pre-conv, transformer) and a conv
  stack: `conv_stack_cl.ChannelsLastConvStack` (the default: time-major GEMMs, NHWC convs, fused
  SnakeBeta passes of `snake_nwc` / `snake_gemm`) or `conv_stack.ConvStack` (the reference layout).
"""

from qtts.decode_engine.slot_decoder import (
    SlotDecoder,
    SlotDecoderConfig,
    SlotState,
    build_slot_decoder,
    load_slot_decoder,
)
from qtts.decode_engine.slots import SlotPool, SlotPoolFull

__all__ = [
    "SlotDecoder",
    "SlotDecoderConfig",
    "SlotState",
    "SlotPool",
    "SlotPoolFull",
    "build_slot_decoder",
    "load_slot_decoder",
]
