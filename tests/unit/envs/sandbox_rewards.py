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


def troubled(response, ground_truth, *, finish_reason, extra_info):
    """1.0 iff the response is the ground truth, unless the response asks for trouble."""
    import os

    if response == "sleep":
        time.sleep(60)
    elif response == "crash":
        os._exit(7)
    elif response == "hog":
        return len(bytearray(4 << 30))
    elif response == "spin":
        while True:
            pass
    elif response == "stubborn":  # swallows its timer's interrupt: only the tool worker's kill stops it
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                time.sleep(60)
            except BaseException:
                pass
    return 1.0 if response == ground_truth else 0.0


CALLS = 0


def counted(response, ground_truth, *, finish_reason, extra_info):
    """How many calls this process has served, this one included ("crash" ends the process instead)."""
    import os

    global CALLS
    CALLS += 1
    if response == "crash":
        os._exit(7)
    return float(CALLS)


def varied(response, ground_truth, *, finish_reason, extra_info):
    """A reward that differs between most responses (the sum of their character codes mod 7): groups get advantages."""
    return float(sum(map(ord, response)) % 7)


def readable(response, ground_truth, *, finish_reason, extra_info):
    """How many of `extra_info["paths"]` this process can read (a file's bytes, a folder's listing)."""
    import os

    seen = 0
    for path in extra_info["paths"]:
        try:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                open(path, "rb").read(1)
            seen += os.path.exists(path)
        except OSError:
            pass
    return float(seen)
