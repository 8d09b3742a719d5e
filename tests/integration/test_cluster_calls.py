"""`named_get`: a call that does not answer in time fails with an error naming the call and whom it waited on,
after the timeout and not much later; one that answers returns its value."""

from __future__ import annotations

import time

import pytest

from asyncrl.cluster.calls import CallTimeout, named_get

pytestmark = pytest.mark.integration


def test_an_answer_in_time_is_returned_and_a_late_one_fails_naming_the_call(ray_cluster):
    @ray_cluster.remote(num_cpus=0)
    def answer(delay_s: float) -> int:
        time.sleep(delay_s)
        return 7

    assert named_get(answer.remote(0.0), 30.0, "quick call") == 7
    started = time.monotonic()
    with pytest.raises(CallTimeout, match=r"^slow worker: answer: no answer within 0\.5s$"):
        named_get(answer.remote(30.0), 0.5, "slow worker: answer")
    assert 0.5 <= time.monotonic() - started < 5
