"""User-style rewards (`sandbox_rewards:<name>`) that the sandbox tests run in a sandboxed process."""

import time


def half(response, ground_truth, *, finish_reason, extra_info):
    print("a reward's prints must not be taken for its value")
    return 0.5 if response == ground_truth else 0.0


def sleepy(response, ground_truth, *, finish_reason, extra_info):
    time.sleep(60)
    return 1.0


def wordy(response, ground_truth, *, finish_reason, extra_info):
    return "one"


def even_index_passes(response, ground_truth, *, finish_reason, extra_info):
    """Prompts with an even `index` are always solved, the others never."""
    return 1.0 if int(extra_info["index"]) % 2 == 0 else 0.0
