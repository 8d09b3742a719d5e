"""Tools an environment calls during an episode, and the executors that run them (and user rewards) outside the
engine's process: the records and the `ToolExecutor` contract (`base`), the built-in tools."""
