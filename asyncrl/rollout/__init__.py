"""Rollout side: the vLLM engine wrapper (`engine`), the worker actor (`worker`), the pool (`pool`), the
OpenAI-compatible endpoint and the agent environment that drives it (`openai_*`), and every vLLM workaround
(`vllm_compat`). The weights' wire formats it loads are `asyncrl.weights`.

Nothing is imported here so that importing one module does not import Ray or vLLM.
"""
