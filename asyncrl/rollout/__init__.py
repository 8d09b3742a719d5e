"""Rollout side: the vLLM engine wrapper (`engine`), the worker actor (`worker`), the pool (`pool`), the
weight transport format shared with the learner (`weights`), and every vLLM workaround (`vllm_compat`).

Nothing is imported here so that `asyncrl.rollout.weights` stays usable without Ray or vLLM.
"""
