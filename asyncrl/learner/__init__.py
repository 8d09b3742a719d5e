"""The learner pool: FSDP2 policy (+ optional critic) ranks as Ray actors forming one torch.distributed
group, micro-batching with exact whole-batch reductions, weight publication and checkpoints.

Modules: `batch` (groups -> padded TrainBatch, rank split, micro-batches), `policy` (the modules and their
FSDP2 sharding), `worker` (LearnerWorker actor, LearnerPool), `publish` (WeightPublisher), `checkpoint`.
Heavy imports (Ray, transformers) happen inside the functions that need them.
"""
