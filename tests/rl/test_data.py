"""Prompt and offline-rollout loading from JSONL and Parquet; every malformed row names file, line and field."""

import json
import sys

import pytest

from longstraw.rl.data import PromptRow, RolloutGroup, load_prompts, load_rollouts


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_load_prompts_jsonl(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "What is 2+2?", "answer": "4", "level": 1},
        "",  # blank lines are skipped
        {"prompt": MSGS, "answer": 42},
        {"prompt": "open-ended"},
    ])
    rows = load_prompts(f)
    assert rows[0] == PromptRow("What is 2+2?", "4", {"level": 1}, f"{f}:1")
    assert rows[1].prompt == MSGS and rows[1].answer == "42" and rows[1].where == f"{f}:3"
    assert rows[2].answer is None and rows[2].meta == {}


def test_load_prompts_custom_keys(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"question": "q", "gold": "a", "prompt": "other"}])
    rows = load_prompts(f, prompt_key="question", answer_key="gold")
    assert rows[0].prompt == "q" and rows[0].answer == "a" and rows[0].meta == {"prompt": "other"}


@pytest.mark.parametrize("line, match", [
    ('{"prompt": "a", ', r"p.jsonl:2: invalid JSON"),
    ('["prompt"]', r"p.jsonl:2: a row must be a JSON object, got list"),
    ('{"answer": "1"}', r"p.jsonl:2: missing field 'prompt' \(the row has: 'answer'\)"),
    ('{"prompt": 5}', r"p.jsonl:2: field 'prompt' must be a string or a non-empty list of messages, got int"),
    ('{"prompt": []}', r"p.jsonl:2: field 'prompt' must be a string or a non-empty list"),
    ('{"prompt": [{"role": "user"}]}', r"p.jsonl:2: field 'prompt'\[0\] must be a message"),
    ('{"prompt": "a", "answer": [1]}', r"p.jsonl:2: field 'answer' must be a string or a number, got list"),
    ('{"prompt": "a", "answer": true}', r"p.jsonl:2: field 'answer' must be a string or a number, got bool"),
])
def test_load_prompts_bad_rows(tmp_path, line, match):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine", "answer": "1"}, line])
    with pytest.raises(ValueError, match=match):
        load_prompts(f)


def test_load_files_bad(tmp_path):
    with pytest.raises(ValueError, match="data file '.*nope.jsonl' does not exist"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "p.csv").write_text("prompt\n")
    with pytest.raises(ValueError, match=r"has suffix '.csv'; allowed: .jsonl, .json, .ndjson, .parquet, .pq"):
        load_prompts(tmp_path / "p.csv")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl' has no rows"):
        load_prompts(tmp_path / "empty.jsonl")


def test_parquet_prompts_and_rollouts(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    f = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": "a", "answer": "1", "src": "x"},
        {"prompt": "b", "answer": None, "src": "y"},
    ]), f)
    rows = load_prompts(f)
    assert [(r.prompt, r.answer, r.meta) for r in rows] == [("a", "1", {"src": "x"}), ("b", None, {"src": "y"})]
    assert rows[1].where == f"{f}:row 2"

    g = tmp_path / "m.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": MSGS, "responses": ["r1", "r2"], "rewards": [1.0, 0.0]}]), g)
    groups = load_rollouts(g)
    assert groups[0].prompt == MSGS and groups[0].rewards == [1.0, 0.0]

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "responses": ["r"], "rewards": [float("nan")]}]), bad)
    with pytest.raises(ValueError, match=r"bad.parquet:row 1: field 'rewards'\[0\] must be finite, got nan"):
        load_rollouts(bad)

    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="broken.parquet: cannot read Parquet"):
        load_prompts(tmp_path / "broken.parquet")


def test_parquet_needs_pyarrow(tmp_path, monkeypatch):
    (tmp_path / "p.parquet").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match=r"needs pyarrow: pip install longstraw\[parquet\]"):
        load_prompts(tmp_path / "p.parquet")


def test_load_rollouts(tmp_path):
    f = write_jsonl(tmp_path / "r.jsonl", [
        {"prompt": "p1", "responses": ["a", "b"], "rewards": [1, 0.5], "answer": "a", "source": "vllm"},
        {"prompt": MSGS, "responses": ["x"], "rewards": [0.0], "old_logprobs": [[-0.1, -2.0]]},
    ])
    g = load_rollouts(f)
    assert g[0] == RolloutGroup("p1", ["a", "b"], [1.0, 0.5], None, "a", {"source": "vllm"}, f"{f}:1")
    assert g[1].prompt == MSGS and g[1].old_logprobs == [[-0.1, -2.0]] and g[1].answer is None
    assert all(isinstance(x, float) for x in g[0].rewards)


OK = {"prompt": "p", "responses": ["a", "b"], "rewards": [1.0, 0.0]}


@pytest.mark.parametrize("row, match", [
    ("{oops", r"r.jsonl:2: invalid JSON"),
    ({"responses": ["a"], "rewards": [1]}, r"r.jsonl:2: missing field 'prompt'"),
    ({"prompt": "p", "rewards": [1]}, r"r.jsonl:2: missing field 'responses'"),
    ({"prompt": "p", "responses": ["a"]}, r"r.jsonl:2: missing field 'rewards'"),
    ({**OK, "responses": "a"}, r"r.jsonl:2: field 'responses' must be a non-empty list of strings"),
    ({**OK, "responses": []}, r"r.jsonl:2: field 'responses' must be a non-empty list of strings"),
    ({**OK, "responses": ["a", 3]}, r"r.jsonl:2: field 'responses'\[1\] must be a string, got int"),
    ({**OK, "rewards": 1.0}, r"r.jsonl:2: field 'rewards' must be a list of numbers"),
    ({**OK, "rewards": [1.0]}, r"r.jsonl:2: field 'rewards' has 1 values but 'responses' has 2"),
    ({**OK, "rewards": [1.0, "0"]}, r"r.jsonl:2: field 'rewards'\[1\] must be a number, got str"),
    ({**OK, "rewards": [1.0, True]}, r"r.jsonl:2: field 'rewards'\[1\] must be a number, got bool"),
    ('{"prompt": "p", "responses": ["a"], "rewards": [NaN]}', r"r.jsonl:2: field 'rewards'\[0\] must be finite, got nan"),
    ('{"prompt": "p", "responses": ["a"], "rewards": [Infinity]}', r"r.jsonl:2: field 'rewards'\[0\] must be finite"),
    ({**OK, "old_logprobs": [[-1.0]]}, r"r.jsonl:2: field 'old_logprobs' must be one list of floats per response "
                                       r"\(2\), got 1"),
    ({**OK, "old_logprobs": "x"}, r"r.jsonl:2: field 'old_logprobs' must be one list .* got str"),
    ({**OK, "old_logprobs": [[-1.0], 5]}, r"r.jsonl:2: field 'old_logprobs'\[1\] must be a list of floats, got int"),
    ({**OK, "old_logprobs": [[-1.0], [-1, "a"]]}, r"r.jsonl:2: field 'old_logprobs'\[1\]\[1\] must be a number"),
    ('{"prompt": "p", "responses": ["a"], "rewards": [1], "old_logprobs": [[-Infinity]]}',
     r"r.jsonl:2: field 'old_logprobs'\[0\]\[0\] must be finite, got -inf"),
    ({**OK, "answer": {"a": 1}}, r"r.jsonl:2: field 'answer' must be a string or a number, got dict"),
    ({**OK, "prompt": None}, r"r.jsonl:2: field 'prompt' must be a string or a non-empty list of messages"),
])
def test_load_rollouts_bad_rows(tmp_path, row, match):
    f = write_jsonl(tmp_path / "r.jsonl", [OK, row])
    with pytest.raises(ValueError, match=match):
        load_rollouts(f)


@pytest.mark.parametrize("loader", [load_prompts, load_rollouts])
def test_non_utf8_names_the_file_and_line(tmp_path, loader):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(json.dumps(OK).encode() + b"\n" + '{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\); save the "
                                         r"file as UTF-8"):
        loader(f)


def test_a_row_without_the_answer_key_names_file_line_key_and_the_row_keys(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q1", "answer": "1"}, {"prompt": "q2", "target": "2"}])
    assert load_prompts(f)[1].answer is None  # optional unless required
    with pytest.raises(ValueError, match=r"p.jsonl:2: the answer 'answer' is missing \(the answer key, set by "
                                         r"data.answer_key; .*\); the row has: 'prompt', 'target'"):
        load_prompts(f, require_answer=True)
    g = write_jsonl(tmp_path / "null.jsonl", [{"prompt": "q", "gold": None}])
    with pytest.raises(ValueError, match=r"null.jsonl:1: the answer 'gold' is null"):
        load_prompts(g, answer_key="gold", require_answer=True)
    h = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q2", "target": "2"}])
    assert load_prompts(h, answer_key="target", require_answer=True)[0].answer == "2"
