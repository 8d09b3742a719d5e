"""The README's code blocks run: its Python example executes and its config excerpt is a valid config, so the
front page cannot drift from the library and the schema."""

import re
import runpy
from pathlib import Path

import yaml

from asyncrl.config import load_config

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", README.read_text(), flags=re.MULTILINE | re.DOTALL)


def test_the_readme_python_example_runs_and_prints_a_finite_loss(tmp_path, capsys):
    (block,) = _blocks("python")
    script = tmp_path / "readme_example.py"
    script.write_text(block)
    runpy.run_path(str(script), run_name="__main__")
    printed = capsys.readouterr().out
    match = re.match(r"loss (-?\d+\.\d+), clipfrac (\d\.\d+), grad norm (\d+\.\d+)", printed)
    assert match, printed
    assert float(match.group(3)) > 0  # the loss reaches the learner's log-probs


def test_the_readme_config_excerpt_is_a_valid_config(tmp_path):
    (block,) = _blocks("yaml")
    path = tmp_path / "excerpt.yaml"
    path.write_text(block)
    config = load_config(path)
    assert config.mode == "streaming"
    assert config.buffer.max_staleness == 4
    assert config.learner.max_steps == 240


def test_the_readme_config_excerpt_agrees_with_the_default_recipe():
    (block,) = _blocks("yaml")
    excerpt = yaml.safe_load(block)
    default = yaml.safe_load((README.parent / "configs" / "default.yaml").read_text())
    for section, values in excerpt.items():
        if isinstance(values, dict) and section in default:
            shared = {k: v for k, v in values.items() if k in default[section]}
            assert shared == {k: default[section][k] for k in shared}, section
        elif section in default:
            assert values == default[section], section


def test_every_relative_link_of_the_readme_and_docs_names_a_file_that_exists():
    root = README.parent
    pages = [README, *sorted((root / "docs").glob("*.md")), root / "deploy" / "README.md"]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(root)} -> {target}")
    assert not missing, missing
