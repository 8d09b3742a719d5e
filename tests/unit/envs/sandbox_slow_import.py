"""A reward module whose import never ends (`sandbox_slow_import:score`)."""

import time

time.sleep(60)


def score(response, ground_truth, *, finish_reason, extra_info):
    return 1.0
