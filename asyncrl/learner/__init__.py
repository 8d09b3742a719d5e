"""The learner: FSDP2 policy (+ optional critic) ranks as Ray actors forming one torch.distributed group,
micro-batching with exact whole-batch reductions, weight export and checkpoints.

Modules by role: `pool` (LearnerPool, the driver-side handle), `rank` (LearnerWorker, one Ray actor per
rank: process group, sharded state, collectives, export, checkpoint), `step` (one rank's optimizer step:
micro-batches, critic advantages, reduction weights, backward, clip and step), `batch` (groups -> padded
TrainBatch, rank split, micro-batches), `policy` (the modules and their FSDP2 sharding), `export` (HF-named
safetensors buckets), `checkpoint`, `memory` (each rank's train-state bytes: `learner.rank_memory_gb`). Heavy
imports (Ray, transformers) happen inside the functions that need them.
"""
