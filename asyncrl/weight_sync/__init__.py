"""Weight sync: the learner's weights to every rollout engine as one policy version.

`base` holds the contract (`WeightSync`: start(version) -> PendingSync, finish(pending) -> SyncResult,
latest(), and the overlap / parity-probe policy) and its records; `object_store` is the transport through
the Ray object store, `shared_memory` the zero-copy one on a single node (its file format in `segment`);
`transport` picks one from `weight_sync.transport`. The package imports nothing here so that `rollout` can
use `base` without cycles.
"""
