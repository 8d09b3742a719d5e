"""asyncrl.algo: the RL math as pure functions of torch tensors.

Modules (each one family, shapes in docstrings, paper links in module docstrings):
    advantages  REINFORCE baseline, GAE, VAPO, GRPO, Dr.GRPO, RLOO, REINFORCE++, ScaleRL batch-norm, MaxRL
    losses      PPO (+dual clip, clip-higher), CISPO, GSPO, GSPO-token, SAPO, DPPO, GVPO, REINFORCE, value loss
    reduction   exact global reductions: per-token weights computed once per optimizer batch
    correction  train-vs-rollout mismatch: TIS, MIS / rejection, IcePop, DIS, decoupled PPO, bypass, OPSM
    kl          k1 / k2 / k3 KL estimators, KL-in-reward
    shaping     DAPO overlong punishment, zero-variance filtering, pass-rate curriculum
    sampling    the engines' processed distribution (temperature, top-k, top-p) recomputed by the learner
    metrics     mismatch metrics as floats
    evaluation  held-out scores of k samples: mean@k, unbiased pass@k
    recipe      the resolved algorithm choice (`Recipe`) and `resolve_recipe`
    recipes     the learner entry points that apply a recipe
    registry    every component and preset by name, the parameters each takes (types, ranges), the checks
                of a choice (imports no torch, so configs can validate cheaply)

This package imports only torch, and `import asyncrl.algo` / `asyncrl.algo.registry` imports nothing heavy.
Formulas, defaults and papers: docs/algorithms.md.
"""
