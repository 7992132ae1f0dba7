"""Synthetic long-context tasks: determinism, token-length fitting (byte and BPE tokenizers), answers, bad input."""

import re

import pytest

from longstraw.rl.tasks import MAX_LENGTH, Sample, check_task, make_task, task_names
from longstraw.tokenizer import ByteTokenizer

TASKS = ["passkey", "kv_retrieval", "variable_tracking"]
BYTE = ByteTokenizer()


def ntok(tok, s):
    return len(tok.encode(s))


@pytest.fixture(scope="module")
def bpe():
    """A tiny BPE tokenizer (trained offline) wrapped to the protocol: token counts are not additive in chars."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from longstraw.rl.tasks import FILLER_SENTENCES
    from longstraw.tokenizer import HFTokenizer

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(FILLER_SENTENCES), "What is the pass key? The value of key 0123456789"],
                            trainer=trainer)
    return HFTokenizer(transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>"))


def test_registry():
    assert task_names() == TASKS
    with pytest.raises(ValueError, match="unknown task 'needle'; built-in tasks: passkey, kv_retrieval, "
                                         "variable_tracking"):
        make_task("needle", 1000, 0, BYTE)


@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize("length", [1000, 4096])
def test_length_and_answer(name, length):
    s = make_task(name, length, 7, BYTE, answer_digits=3)
    assert isinstance(s, Sample)
    n = ntok(BYTE, s.prompt)
    tol = max(4, length // 500)
    assert length - tol <= n <= length
    assert n == length  # the byte tokenizer lands exactly
    assert s.meta["prompt_tokens"] == n and s.meta["task"] == name and s.meta["length"] == length
    assert re.fullmatch(r"[1-9]\d\d", s.answer)
    assert s.prompt.endswith(" is ")  # the ideal response is the answer, then EOS


@pytest.mark.parametrize("name", TASKS)
def test_deterministic_per_seed(name):
    a = make_task(name, 2000, 11, BYTE)
    b = make_task(name, 2000, 11, BYTE)
    c = make_task(name, 2000, 12, BYTE)
    assert a == b
    assert a.prompt != c.prompt


def test_passkey_content():
    s = make_task("passkey", 2000, 3, BYTE, answer_digits=5, depth=0.5)
    assert s.prompt.count(s.answer) == 1  # nothing else has digits
    assert s.prompt.endswith("\nThe pass key is ")
    pos = s.prompt.index(s.answer) / len(s.prompt)
    assert 0.4 < pos < 0.6
    assert s.meta["depth"] == 0.5
    early = make_task("passkey", 2000, 3, BYTE, depth=0.0)
    assert early.prompt.index(early.answer) < 60
    assert len({make_task("passkey", 500, sd, BYTE, answer_digits=1).answer for sd in range(40)}) > 5


def test_answer_digits_one_and_32():
    assert re.fullmatch(r"\d", make_task("passkey", 500, 0, BYTE, answer_digits=1).answer)
    assert re.fullmatch(r"[1-9]\d{31}", make_task("passkey", 500, 0, BYTE, answer_digits=32).answer)


def test_kv_retrieval_content():
    s = make_task("kv_retrieval", 3000, 5, BYTE, answer_digits=4, key_length=6)
    key = s.meta["key"]
    assert re.fullmatch(r"[a-z0-9]{6}", key)
    lines = re.findall(r"^([a-z0-9]{6}): (\d{4})$", s.prompt, flags=re.M)
    assert len(lines) == s.meta["pairs"] > 50
    keys = [k for k, _ in lines]
    assert len(set(keys)) == len(keys) and dict(lines)[key] == s.answer
    assert keys.index(key) == s.meta["position"]
    assert s.prompt.endswith(f"\nThe value of key {key} is ")


def test_variable_tracking_content():
    s = make_task("variable_tracking", 3000, 2, BYTE, answer_digits=4, hops=3, chains=3)
    stmts = re.findall(r"VAR ([A-Z]{5}) = (\w+)\.", s.prompt)
    assert len(stmts) == 3 * 4
    values = {}
    for name, rhs in stmts:  # resolve in order of appearance: every copy refers to an earlier variable
        values[name] = rhs if rhs.isdigit() else values[rhs]
    assert values[s.meta["variable"]] == s.answer
    assert len({v for v in values.values()}) == 3  # distinct chain values
    asked = s.meta["variable"]
    assert s.prompt.endswith(f"\nThe value of VAR {asked} is ")


def test_variable_tracking_zero_hops():
    s = make_task("variable_tracking", 1000, 0, BYTE, hops=0, chains=1)
    assert f"VAR {s.meta['variable']} = {s.answer}." in s.prompt


@pytest.mark.parametrize("name", TASKS)
def test_one_million_tokens(name):
    length = 1_048_576
    s = make_task(name, length, 1, BYTE)
    assert ntok(BYTE, s.prompt) == length


@pytest.mark.filterwarnings("error")  # "could not fit" would be a failure
@pytest.mark.parametrize("name", TASKS)
def test_bpe_tokenizer_within_tolerance(bpe, name):
    for length in (1000, 1500, 4096):
        for seed in range(4):
            s = make_task(name, length, seed, bpe, answer_digits=2)
            n = ntok(bpe, s.prompt)
            assert length - max(4, length // 500) <= n <= length, (name, length, seed, n)
            assert s.meta["prompt_tokens"] == n


def test_bpe_encodes_few_times(bpe):
    """O(length): the whole prompt is tokenised a handful of times, not once per adjustment of a character."""
    calls = []

    class Counting:
        def encode(self, text):
            calls.append(len(text))
            return bpe.encode(text)

        decode = bpe.decode

    s = make_task("passkey", 50_000, 0, Counting())
    assert ntok(bpe, s.prompt) <= 50_000
    assert sum(c > 100_000 for c in calls) <= 4, calls


@pytest.mark.parametrize("kwargs, match", [
    ({"length": 0}, r"length=0 is out of range; allowed: \[1, 16777216\]"),
    ({"length": MAX_LENGTH + 1}, r"length=16777217 is out of range"),
    ({"length": 1000.0}, r"length=1000.0 must be an integer"),
    ({"length": True}, r"length=True must be an integer"),
    ({"length": 30}, r"length=30 is too short for task 'passkey' with this tokenizer: its fixed text alone is "
                     r"\d+ tokens; allowed: \[\d+, 16777216\]"),
    ({"seed": -1}, r"seed=-1 is out of range"),
    ({"seed": "a"}, r"seed='a' must be an integer"),
    ({"answer_digits": 0}, r"answer_digits=0 is out of range; allowed: \[1, 32\]"),
    ({"answer_digits": 33}, r"answer_digits=33 is out of range; allowed: \[1, 32\]"),
    ({"depth": 1.5}, r"depth=1.5 must be a number in \[0, 1\]"),
    ({"tolerance": -1}, r"tolerance=-1 is out of range"),
    ({"colour": "red"}, r"unknown option 'colour' for task 'passkey'; allowed: answer_digits, depth, tolerance"),
    ({"tokenizer": "bytes"}, r"tokenizer='bytes' is not a tokenizer"),
])
def test_bad_parameters(kwargs, match):
    args = {"name": "passkey", "length": 1000, "seed": 0, "tokenizer": BYTE, **kwargs}
    with pytest.raises(ValueError, match=match):
        make_task(**args)


@pytest.mark.parametrize("name, kwargs, match", [
    ("kv_retrieval", {"key_length": 2}, r"key_length=2 is out of range; allowed: \[4, 64\]"),
    ("variable_tracking", {"hops": -1}, r"hops=-1 is out of range; allowed: \[0, 64\]"),
    ("variable_tracking", {"chains": 0}, r"chains=0 is out of range; allowed: \[1, 64\]"),
    ("variable_tracking", {"chains": 11, "answer_digits": 1}, r"chains=11 needs distinct values"),
    ("variable_tracking", {"depth": 0.5}, r"unknown option 'depth' for task 'variable_tracking'"),
])
def test_bad_task_options(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_task(name, 2000, 0, BYTE, **kwargs)


def test_unreachable_length_warns_and_stays_below():
    class EvenOnly:  # token counts are always even: an odd target with tolerance 0 cannot be met
        def encode(self, text):
            return [0] * (2 * (len(text) // 10))

        def decode(self, ids):
            return ""

    with pytest.warns(UserWarning, match="could not fit length=2001 within tolerance=0"):
        s = make_task("passkey", 2001, 0, EvenOnly(), tolerance=0)
    assert s.meta["prompt_tokens"] == 2000


def test_short_prompts_for_tiny_models():
    # the fixed text is short, so a tiny model can be trained on prompts of ~100 tokens
    s = make_task("passkey", 64, 0, BYTE, answer_digits=2)
    assert ntok(BYTE, s.prompt) == 64
    assert ntok(BYTE, make_task("kv_retrieval", 100, 0, BYTE, answer_digits=2).prompt) == 100
    assert ntok(BYTE, make_task("variable_tracking", 200, 0, BYTE, answer_digits=2, hops=2, chains=2).prompt) == 200


def test_check_task():
    check_task("passkey", answer_digits=3, depth=None)
    check_task("variable_tracking", chains=10, answer_digits=1)
    with pytest.raises(ValueError, match="unknown task 'x'"):
        check_task("x")
    with pytest.raises(ValueError, match="unknown option 'hops' for task 'passkey'"):
        check_task("passkey", hops=2)
    with pytest.raises(ValueError, match=r"answer_digits=0 is out of range"):
        check_task("kv_retrieval", answer_digits=0)
    with pytest.raises(ValueError, match=r"depth=-0.1 must be a number in \[0, 1\]"):
        check_task("kv_retrieval", depth=-0.1)
    with pytest.raises(ValueError, match=r"chains=11 needs distinct values"):
        check_task("variable_tracking", chains=11, answer_digits=1)
