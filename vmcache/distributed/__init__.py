"""vmcache beyond one process, over ``torch.distributed``: whole-sequence hand-off
(:mod:`.transfer`), disaggregated prefill → decode serving (:mod:`.disagg`) and tensor
parallelism with KV heads sharded across ranks (:mod:`.tp`)."""

from vmcache.distributed.handoff import (
    CONTROL_MESSAGES,
    Arrival,
    HandoffStats,
    TransferError,
    plan_handoff,
    recv_sequence,
    send_sequence,
)

__all__ = [
    "CONTROL_MESSAGES",
    "Arrival",
    "HandoffStats",
    "TransferError",
    "plan_handoff",
    "recv_sequence",
    "send_sequence",
]
