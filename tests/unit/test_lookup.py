"""The one "did you mean" and the one loader of a built-in name or `module:attr`."""

import json

import pytest

from asyncrl.lookup import check_name, did_you_mean, load_plugin

BUILTINS = {"exact": json.dumps, "loads": "json:loads"}


def test_did_you_mean_names_the_closest_option_or_nothing():
    assert did_you_mean("grpoo", ["grpo", "gspo", "cispo"]) == " (did you mean 'grpo'?)"
    assert did_you_mean("zzz", ["grpo", "gspo"]) == ""
    # 'lerner' ~ 'learner' at ratio 2 * 6 / 13 = 0.92; 'ab' ~ 'abcd' at 2 * 2 / 6 = 0.67: in at 0.6, out at 0.7.
    assert did_you_mean("ab", ["abcd"]) == " (did you mean 'abcd'?)"
    assert did_you_mean("ab", ["abcd"], cutoff=0.7) == ""


def test_check_name_names_the_kind_the_closest_and_every_valid_name():
    check_name("loss", "ppo", ("ppo", "cispo"))
    with pytest.raises(ValueError, match=r"^unknown loss 'cipso' \(did you mean 'cispo'\?\); valid: ppo, cispo$"):
        check_name("loss", "cipso", ("ppo", "cispo"))


def test_a_builtin_is_the_object_itself_or_the_import_path_it_names():
    assert load_plugin("exact", "reward", BUILTINS) is json.dumps
    assert load_plugin("loads", "reward", BUILTINS) is json.loads
    assert load_plugin("json:dumps", "reward", BUILTINS) is json.dumps


@pytest.mark.parametrize(
    "name, builtins, message",
    [
        ("exac", BUILTINS, "unknown reward 'exac': use one of exact, loads or 'module:function'"),
        ("nocolon", None, "reward 'nocolon' must be an import path 'module:function'"),
        (":dumps", None, "reward ':dumps' must be an import path 'module:function'"),
        ("no_such_module_xyz:f", BUILTINS, "cannot import reward 'no_such_module_xyz:f': No module named"),
        ("json:no_such_attr", BUILTINS, "cannot import reward 'json:no_such_attr'"),
    ],
)
def test_a_bad_name_fails_naming_what_was_looked_for(name, builtins, message):
    with pytest.raises(ValueError) as err:
        load_plugin(name, "reward", builtins)
    assert message in str(err.value)
