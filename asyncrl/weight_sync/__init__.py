"""Weight sync: the learner's weights to every rollout engine as one policy version.

`base` holds the contract (`WeightSync`: start(version) -> PendingSync, finish(pending) -> SyncResult,
latest(), and the overlap / parity-probe policy) and its records; `ends` what a transport needs of the
learner and of the rollout pool (protocols, so that this package sits above both pools without importing
them); `object_store` is the transport through the Ray object store, `shared_memory` the zero-copy one on a
single node, `collective` the broadcast over a torch.distributed group per engine; the last two share
`staged` (rank 0 stages the state, engines get a small record); `delta` sends only what changed through the
object store (`weight_sync.delta`). `transport` picks one from `weight_sync.transport` and `weight_sync.delta`
(docs/weight_sync.md). The formats on the wire are `asyncrl.weights` (below both pools).
"""
