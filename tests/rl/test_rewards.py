"""Rewards: built-ins, user functions (module and file), and scoring with recorded errors and real timeouts."""

import math
import textwrap

import pytest

from longstraw.rl.rewards import BUILTINS, RewardResult, make_reward, parse_number, score_rewards


def one(spec, response, answer, **options):
    return make_reward(spec, **options)(response, answer)


def test_exact_match():
    assert one("exact_match", "  4821\n", "4821") == 1.0
    assert one("exact_match", "4821 ", " 4822") == 0.0
    assert one("exact_match", "Paris", "paris") == 0.0
    assert one("exact_match", "Paris", "paris", case_sensitive=False) == 1.0


def test_contains():
    assert one("contains", "the key is 4821.", "4821") == 1.0
    assert one("contains", "the key is 482", "4821") == 0.0
    assert one("contains", "PARIS!", "paris", case_sensitive=False) == 1.0
    assert one("contains", "PARIS!", "paris") == 0.0


def test_regex():
    # no pattern: the answer is the pattern
    assert one("regex", "id: ab12", r"[a-z]{2}\d{2}") == 1.0
    assert one("regex", "id: ab12", r"[a-z]{2}\d{2}", mode="full") == 0.0
    # a fixed pattern without groups: match or not
    assert one("regex", " 4821 ", "ignored", pattern=r"\d{4}", mode="full") == 1.0
    # a capture group is compared with the answer
    r = make_reward("regex", pattern=r"answer is (\w+)")
    assert r("so the answer is 42.", "42") == 1.0
    assert r("so the answer is 41.", "42") == 0.0
    assert r("no idea", "42") == 0.0
    assert one("regex", "ANSWER IS X", "x", pattern=r"answer is (\w+)", case_sensitive=False) == 1.0


@pytest.mark.parametrize("response, answer, want", [
    ("The answer is 1,000 apples", "1000", 1.0),
    ("1e3", "1000", 1.0),
    ("about 3/4 of them", "0.75", 1.0),
    ("0.75", "3/4", 1.0),
    ("-12.5 degrees", "-12.5", 1.0),
    ("x = .5", "0.5", 1.0),
    ("1000.0000001", "1000", 1.0),  # within rel_tol 1e-6
    ("1001", "1000", 0.0),
    ("first 7 then 8", "8", 0.0),  # the FIRST number counts
    ("no number here", "5", 0.0),
    ("12,34", "12", 1.0),  # '12,34' is not a thousands group: the first number is 12
])
def test_numeric(response, answer, want):
    assert one("numeric", response, answer) == want


def test_numeric_tolerances_and_bad_answer():
    assert one("numeric", "1.05", "1", rel_tol=0.1) == 1.0
    assert one("numeric", "1.05", "1") == 0.0
    assert one("numeric", "0.001", "0", abs_tol=0.01) == 1.0
    with pytest.raises(ValueError, match="answer 'abc' is not a number"):
        one("numeric", "1", "abc")


def test_parse_number():
    assert parse_number("x 1,234,567.5 y") == 1234567.5
    assert parse_number("3 / 4") == 0.75
    assert parse_number("5/0") == 5.0  # no division by zero: the numerator stands
    assert parse_number("none") is None
    assert parse_number("12 apples", whole=True) is None
    assert parse_number(" 2.5e-3 ", whole=True) == 0.0025


def test_digit_match_is_shaped():
    r = make_reward("digit_match")
    assert r("4821", "4821") == 1.0
    assert r(" 4821\n", "4821") == 1.0
    assert r("4820", "4821") == 0.75
    assert r("48", "4821") == 0.5
    assert r("482199", "4821") == pytest.approx(4 / 6)  # extra characters cost credit
    assert r("", "4821") == 0.0
    assert r("", "") == 1.0


def test_builtins_ignore_meta():
    # meta keys named like options must not change a built-in's behaviour
    r = make_reward("exact_match")
    assert r("A", "a", case_sensitive=False, task="passkey") == 0.0


@pytest.mark.parametrize("spec, options, match", [
    ("bleu", {}, r"unknown reward 'bleu'; built-ins: exact_match, contains, regex, numeric, digit_match"),
    ("", {}, r"reward spec '' must be a non-empty string"),
    ("exact_match", {"strip": False}, r"unknown option 'strip' for reward 'exact_match'; allowed: case_sensitive"),
    ("digit_match", {"x": 1}, r"unknown option 'x' for reward 'digit_match'; allowed: \(none\)"),
    ("exact_match", {"case_sensitive": "no"}, r"case_sensitive='no' must be true or false"),
    ("regex", {"mode": "prefix"}, r"mode='prefix'; allowed: 'search', 'full'"),
    ("regex", {"pattern": "(unclosed"}, r"pattern='\(unclosed' is not a valid regular expression"),
    ("regex", {"pattern": 3}, r"pattern=3 must be a string"),
    ("numeric", {"rel_tol": -1}, r"rel_tol=-1 must be a finite number >= 0"),
    ("numeric", {"abs_tol": math.inf}, r"abs_tol=inf must be a finite number >= 0"),
])
def test_make_reward_bad_specs(spec, options, match):
    with pytest.raises(ValueError, match=match):
        make_reward(spec, **options)


def test_builtin_names():
    assert list(BUILTINS) == ["exact_match", "contains", "regex", "numeric", "digit_match", "digits_shaped"]


USER_CODE = textwrap.dedent('''
    import math
    import os
    from dataclasses import dataclass

    @dataclass
    class Box:  # a dataclass needs its module in sys.modules
        v: float

    def good(response, answer, bonus=0.0, **meta):
        print("user output goes to stderr, not into the protocol")
        return Box(float(response.strip() == answer) + bonus).v

    def spin(response, answer, **meta):
        if response == "spin":
            while True:
                pass
        return 1.0

    def bad(response, answer, **meta):
        if response == "raise":
            raise RuntimeError("boom")
        if response == "nan":
            return math.nan
        if response == "inf":
            return -math.inf
        if response == "str":
            return "1.0"
        if response == "none":
            return None
        if response == "exit":
            os._exit(3)
        if response == "sysexit":
            raise SystemExit(2)
        if response == "array":
            import numpy
            return numpy.array(0.25)
        return True  # a bool is a number (1.0)

    NOT_CALLABLE = 3
''')


@pytest.fixture()
def user_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(USER_CODE)
    return f


def test_user_function_from_file(user_file):
    with make_reward(f"{user_file}:good", bonus=0.5) as r:
        assert not r.builtin
        assert r("a", "a") == 1.5  # direct calls run in-process
        res = score_rewards(r, ["a", "b"], ["a", "a"], [{}, {}], timeout_s=5)
        assert res == [RewardResult(1.5, None), RewardResult(0.5, None)]


def test_user_function_from_module(tmp_path, monkeypatch):
    (tmp_path / "my_reward_mod.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with make_reward("my_reward_mod:good") as r:
        assert score_rewards(r, ["x"], ["x"], [{"bonus": 1.0}], timeout_s=5) == [RewardResult(2.0, None)]
        assert score_rewards(r, ["x"], ["x"], [{"bonus": 1.0}], timeout_s=None) == [RewardResult(2.0, None)]


def test_user_function_errors_are_recorded(user_file):
    cases = ["raise", "nan", "inf", "str", "none", "sysexit", "exit", "array", "ok"]
    with make_reward(f"{user_file}:bad") as r:
        for timeout in (5, None):
            cs = [c for c in cases if timeout is not None or c != "exit"]
            res = score_rewards(r, cs, ["1"] * len(cs), None, timeout_s=timeout)
            got = dict(zip(cs, res))
            assert got["raise"] == RewardResult(0.0, "RuntimeError: boom")
            assert got["nan"].value == 0.0 and "not finite: nan" in got["nan"].error
            assert got["inf"].value == 0.0 and "not finite: -inf" in got["inf"].error
            assert got["str"].value == 0.0 and "not a number: str '1.0'" in got["str"].error
            assert got["none"].value == 0.0 and "not a number: NoneType" in got["none"].error
            assert got["ok"] == RewardResult(1.0, None)
            assert got["array"] == RewardResult(0.25, None)  # a 0-d array is a number
            assert "SystemExit" in got["sysexit"].error
            if timeout is not None:
                assert "exited with code 3" in got["exit"].error  # the worker died; the next call restarts it


def test_timeout_kills_an_infinite_loop(user_file):
    with make_reward(f"{user_file}:spin") as r:
        score_rewards(r, ["warm"], ["1"], None, timeout_s=5)  # worker start-up is not part of the timeout
        res = score_rewards(r, ["a", "spin", "b", "spin", "c"], ["1"] * 5, None, timeout_s=0.5)
    # the spinning calls were cut off (a worker that waited for them would never return: the test's timeout)
    assert [x.value for x in res] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert "timeout" in res[1].error and "0.5 s" in res[1].error and res[3].error == res[1].error
    assert res[0].error is None and res[2].error is None


def test_unpicklable_meta_is_recorded(user_file):
    with make_reward(f"{user_file}:good") as r:
        res = score_rewards(r, ["a", "a"], ["a", "a"], [{"f": lambda: 0}, {}], timeout_s=5)
    assert res[0].value == 0.0 and "cannot send the arguments" in res[0].error
    assert res[1] == RewardResult(1.0, None)


def test_builtin_errors_are_recorded():
    r = make_reward("numeric")
    res = score_rewards(r, ["1", "2", "x"], ["1", "abc", "3"], None)
    assert res[0] == RewardResult(1.0, None)
    assert res[1].value == 0.0 and "answer 'abc' is not a number" in res[1].error
    assert res[2] == RewardResult(0.0, None)
    res = score_rewards(make_reward("exact_match"), ["a"], [None])
    assert res[0].value == 0.0 and "AttributeError" in res[0].error


def test_builtins_run_in_process_without_a_worker():
    r = make_reward("digit_match")
    res = score_rewards(r, ["4821"] * 2000, ["4820"] * 2000, None, timeout_s=1)
    assert all(x == RewardResult(0.75, None) for x in res)
    assert r._worker is None  # no process was started for a built-in


@pytest.mark.parametrize("spec, match", [
    ("no_such_module_xyz:fn", r"cannot import module 'no_such_module_xyz' for function 'fn'"),
    ("{dir}/missing.py:fn", r"file '.*missing.py' does not exist \(looking for function 'fn'\)"),
    ("{file}:nope", r"has no function 'nope'"),
    ("{file}:NOT_CALLABLE", r"'NOT_CALLABLE' is not callable"),
    ("{file}:", r"a user function is given as 'module:function'"),
    ("json:", r"a user function is given as 'module:function'"),
    ("{broken}:fn", r"cannot import file '.*broken.py' for function 'fn': ZeroDivisionError"),
])
def test_user_function_import_errors(user_file, spec, match):
    broken = user_file.parent / "broken.py"
    broken.write_text("x = 1 / 0\n")
    spec = spec.format(dir=user_file.parent, file=user_file, broken=broken)
    with pytest.raises(ValueError, match=match):
        make_reward(spec)


def test_score_rewards_bad_arguments():
    r = make_reward("exact_match")
    with pytest.raises(ValueError, match="2 responses, 1 answers"):
        score_rewards(r, ["a", "b"], ["a"])
    with pytest.raises(ValueError, match="2 responses, 2 answers, 1 metas"):
        score_rewards(r, ["a", "b"], ["a", "b"], [{}])
    with pytest.raises(ValueError, match="timeout_s=0 must be a number > 0"):
        score_rewards(r, ["a"], ["a"], timeout_s=0)


def test_worker_survives_stdout_noise_and_many_calls(user_file):
    with make_reward(f"{user_file}:good") as r:
        res = score_rewards(r, ["a"] * 300, ["a"] * 300, None, timeout_s=5)
    assert all(x == RewardResult(1.0, None) for x in res)


def test_close_is_idempotent(user_file):
    r = make_reward(f"{user_file}:good")
    score_rewards(r, ["a"], ["a"], None, timeout_s=5)
    proc = r._worker.proc
    r.close()
    r.close()
    assert proc.poll() is not None  # the worker process is gone


def test_repr_shows_options():
    assert repr(make_reward("exact_match", case_sensitive=False)) == "RewardFn('exact_match', case_sensitive=False)"


def test_digits_shaped_rewards_format_then_correctness():
    from longstraw.rl.rewards import digits_shaped

    assert digits_shaped("73", "73") == 1.0
    assert digits_shaped("xy", "73") == 0.0
    assert digits_shaped("19", "73") == 0.5  # right format, wrong digits
    assert digits_shaped("13", "73") == 0.75  # one digit right
    assert digits_shaped("7345", "73") == 0.5 * 0.5 + 0.5 * 0.5  # extra characters dilute both terms
    assert digits_shaped("7", "73") == 0.5 * 0.5 + 0.5 * 0.5


# ------------------------------------------------------------------------ user functions live in the worker only


def test_make_reward_never_imports_the_user_module_here(tmp_path, monkeypatch):
    import sys

    (tmp_path / "side_effect_mod.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with make_reward("side_effect_mod:good") as r:
        assert "side_effect_mod" not in sys.modules
        assert r("x", "x") == 1.0  # a direct call goes to the worker too
        assert "side_effect_mod" not in sys.modules
    f = tmp_path / "by_path.py"
    f.write_text(USER_CODE)
    with make_reward(f"{f}:bad") as r:
        assert not [m for m in sys.modules if m.startswith("_longstraw_reward_")]
        with pytest.raises(RuntimeError, match=r"reward '.*by_path.py:bad': RuntimeError: boom"):
            r("raise", "1")


@pytest.mark.timeout(60)
def test_an_import_that_hangs_is_a_value_error_after_the_startup_timeout(tmp_path, monkeypatch):
    import longstraw.rl.rewards as rewards

    f = tmp_path / "hangs.py"
    f.write_text("import time\ntime.sleep(600)\ndef fn(r, a, **m):\n    return 1.0\n")
    monkeypatch.setattr(rewards, "_STARTUP_TIMEOUT_S", 1.0)
    with pytest.raises(ValueError, match=r"reward '.*hangs.py:fn': the reward worker did not import the function "
                                         r"within 1 s"):
        make_reward(f"{f}:fn")  # returns after the start-up timeout (else the test's own timeout fails it)


def test_an_import_that_kills_the_process_is_a_value_error(tmp_path):
    f = tmp_path / "dies.py"
    f.write_text("import os\nos._exit(5)\n")
    with pytest.raises(ValueError, match=r"the reward worker exited with code 5 while importing the function"):
        make_reward(f"{f}:fn")


def test_the_worker_is_a_stdlib_script_that_imports_neither_torch_nor_longstraw(tmp_path):
    from pathlib import Path

    from longstraw.rl.rewards import WORKER_PATH

    src = Path(WORKER_PATH).read_text()
    assert "import torch" not in src and "longstraw" not in src.split('"""')[2]  # code after the module doc
    f = tmp_path / "probe.py"
    f.write_text("import sys\ndef heavy(r, a, **m):\n"
                 "    return float(sum(n == 'torch' or n.split('.')[0] == 'longstraw' for n in sys.modules))\n")
    with make_reward(f"{f}:heavy") as r:
        assert score_rewards(r, ["x"], ["x"], None, timeout_s=5) == [RewardResult(0.0, None)]
        assert r._worker.proc.args[:2] == [__import__("sys").executable, "-I"]
