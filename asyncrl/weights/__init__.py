"""The weights' wire formats, shared by the learner (publisher), the rollout engines (receivers) and the
weight-sync transports between them.

`buckets`: safetensors buckets of Hugging Face-named tensors (the object-store transport). `segment`: the
shared-memory segment's file layout and its reader and writer. `group`: the collective transport's wire over
a torch.distributed group per engine. `delta`: what changed since an engine's version, and the digests that
check it. `published`: the records of one published version. `adapter`: the record of one published LoRA
adapter (`learner.lora`).

This package sits on the lowest layers (beside `cluster` and `algo`; it imports nothing of asyncrl):
`learner`, `rollout` and `weight_sync` all import it, and nothing here imports them. Nothing is imported
here so that each module stays usable without Ray or vLLM.
"""
