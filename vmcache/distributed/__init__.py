"""vmcache beyond one process, over ``torch.distributed``: whole-sequence hand-off
(:mod:`.handoff`, its binary metadata in :mod:`.wire`), disaggregated prefill → decode
serving (:mod:`.disagg`), tensor parallelism with KV heads sharded across ranks (:mod:`.tp`),
the launcher of both (:mod:`.launch`) and the fork server its processes start from
(:mod:`.forkserver`)."""

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
