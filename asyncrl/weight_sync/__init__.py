"""Weight sync: the learner's weights to every rollout engine as one policy version.

`base` holds the contract (`WeightSync`: start(version) -> PendingSync, finish(pending) -> SyncResult,
latest(), and the overlap / parity-probe policy) and its records; `object_store` is the transport through
the Ray object store, `shared_memory` the zero-copy one on a single node (its file format in `segment`),
`collective` the broadcast over a torch.distributed group per engine (its wire in `group`); the last two
share `staged` (rank 0 stages the state, engines get a small record). `transport` picks one from
`weight_sync.transport`. The package imports nothing here so that `rollout` can use `base` without cycles.
"""
