"""A preset shipped in one Ray session and again in a later one, in the same process: the second session gets its
own archive (job ids restart in every session, so a cache keyed by job alone handed back the dead session's ref)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import ray
    from asyncrl.models import cache_root
    from asyncrl.models.shipping import ship, unpack

    folder = cache_root() / "models" / "shipping-sessions-test"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    for session in range(2):
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        shipped = ship(folder)
        data = ray.get(shipped.archive, timeout=30)  # raises for a ref of the previous session
        unpack(data, Path(sys.argv[1]) / f"session-{session}")
        ray.shutdown()
    print("two sessions shipped", flush=True)
    """
)


def test_a_second_ray_session_in_one_process_ships_the_model_again(tmp_path):
    env = {**os.environ, "ASYNCRL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "two sessions shipped" in done.stdout
    assert (tmp_path / "session-0" / "config.json").read_text() == "{}"
    assert (tmp_path / "session-1" / "config.json").read_text() == "{}"
