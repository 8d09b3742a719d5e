"""The megatron learner backend (`learner.training_backend = megatron`): megatron-core's `GPTModel` with tensor
parallelism, driven by the same step as the FSDP2 backend (`asyncrl.learner.step`). `model.py` builds the policy,
`convert.py` holds the per-family Hugging Face converters, `cpu.py` the CPU stand-ins for megatron's CUDA calls,
`state.py` the train state, its gradient reduction and its checkpoints, `switch.py` a checkpoint converted to the FSDP2
backend's and back (`asyncrl convert-checkpoint`)."""
