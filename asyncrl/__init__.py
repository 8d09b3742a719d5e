"""asyncrl: asynchronous actor-learner RL for LLMs.

How the pieces fit and the invariants the code refers to by number ("invariant 3"): docs/architecture.md.
Every formula in `asyncrl.algo`, with its paper: docs/algorithms.md. Every config key: docs/configuration.md.
"""

__version__ = "0.1.0"
