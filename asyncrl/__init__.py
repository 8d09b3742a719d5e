"""asyncrl: asynchronous actor-learner RL for LLMs."""
__version__ = "0.1.0"
