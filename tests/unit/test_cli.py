import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from asyncrl.cli import main

BAD = Path(__file__).parent.parent / "assets" / "bad_configs"


def test_check_default_prints_resolved_config_and_placement(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    config_text, placement_text = out.split("# planned placement\n")
    assert yaml.safe_load(config_text)["mode"] == "streaming"
    plan = json.loads(placement_text)
    assert plan["rollout_pool"]["workers"] == 1 and plan["learner_pool"]["ranks"] == 1
    assert plan["learner_pool"]["sharding"] == "none (one rank)"
    assert plan["total"] == {"CPU": 2.0, "GPU": 0.0}


def test_check_accepts_overrides_without_a_config_file(capsys):
    assert main(["check", "rollout.num_workers=3", "learner.num_ranks=2"]) == 0
    plan = json.loads(capsys.readouterr().out.split("# planned placement\n")[1])
    assert plan["total"]["CPU"] == 5.0
    assert plan["learner_pool"]["sharding"] == "FSDP2 fully_shard"


def test_check_names_when_one_rank_is_wrapped_and_refuses_never_with_two_ranks(capsys):
    assert main(["check", "learner.fsdp=always"]) == 0
    assert json.loads(capsys.readouterr().out.split("# planned placement\n")[1])["learner_pool"]["sharding"] == "FSDP2 fully_shard"
    assert main(["check", "learner.fsdp=never", "learner.num_ranks=2"]) == 2
    assert "learner.fsdp = 'never'" in capsys.readouterr().err


def test_check_on_a_broken_file_fails_naming_the_key(capsys):
    assert main(["check", str(BAD / "typo_key.yaml")]) == 2
    err = capsys.readouterr().err
    assert "samples_per_promt" in err and "typo_key.yaml" in err


def test_help_answers_fast_without_heavy_imports():
    code = "import sys, asyncrl.cli as c; c._parser(); print(sorted(m for m in ('torch','ray','vllm','transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    exe = Path(sys.executable).parent / "asyncrl"
    done = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True, env=os.environ)
    assert "check" in done.stdout and "run" in done.stdout
