"""Fixtures F-POL and F-ADV (built in helpers.py); F-ADV is the worked example of docs/algorithms.md#advantages."""

from __future__ import annotations

import pytest

from .helpers import NAN, NEG_INF, Pol, make_fadv, make_fpol


@pytest.fixture
def fpol() -> Pol:
    return make_fpol()


@pytest.fixture
def fpol_garbage_pads() -> Pol:
    """F-POL with -inf / NaN in the padded slot [1, 3]: results must equal the clean fixture's."""
    return make_fpol(pad_logp=NEG_INF, pad_old=NAN, pad_rollout=NAN)


@pytest.fixture
def fadv():
    return make_fadv()
