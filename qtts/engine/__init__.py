"""The talker's GPU engine: continuous batching over static KV slots, one CUDA graph per frame
step, GPU sampling. Bookkeeping (`kv_slots`, `slot_scheduler`, `sequence`) is pure Python; all tensor
work is in `model_runner`. See docs/engine.md."""

from qtts.engine.engine import GraphEngine, GraphEngineConfig
from qtts.engine.model_runner import RunnerConfig
from qtts.engine.slot_scheduler import NoFreeSlot

__all__ = ["GraphEngine", "GraphEngineConfig", "NoFreeSlot", "RunnerConfig"]
