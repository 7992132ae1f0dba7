"""Tokenizer protocol: the byte tokenizer, HF tokenizers loaded offline from a tmp directory, prompt rendering."""

import json
import sys

import pytest

from longstraw.tokenizer import (BYTE_TOKENIZER_FILE, ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer,
                                 render_prompt)

CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny BPE tokenizer trained offline on a few strings, saved like a checkpoint's tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The grass is green. The sky is blue.", "What is the pass key? 12345 67890"],
                            trainer=trainer)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                              unk_token="<unk>")
    hf.chat_template = CHAT_TEMPLATE
    d = tmp_path_factory.mktemp("hf_tok")
    hf.save_pretrained(str(d))
    return d


def test_byte_roundtrip_and_ids():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (259, 256, 257, 258)
    text = "pass key 4821 — naïve ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode("") == []


def test_byte_decode_invalid_utf8_and_specials():
    tok = ByteTokenizer()
    assert tok.decode([0xFF, 0x41, 0xC3]) == "\ufffdA\ufffd"  # never raises on invalid UTF-8
    ids = [tok.BOS] + tok.encode("hi") + [tok.EOS, tok.PAD]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>hi<|eos|><|pad|>"
    # a multi-byte character split by a special token decodes both halves with replacement
    e = "é".encode()
    assert tok.decode([e[0], tok.EOS, e[1]]) == "\ufffd\ufffd"


def test_byte_decode_bad_id():
    with pytest.raises(ValueError, match="token id 300 is outside"):
        ByteTokenizer().decode([65, 300])
    with pytest.raises(ValueError, match="encode needs a str, got int"):
        ByteTokenizer().encode(5)


def test_byte_save_load(tmp_path):
    ByteTokenizer().save(tmp_path)
    assert json.loads((tmp_path / BYTE_TOKENIZER_FILE).read_text())["eos_token_id"] == 257
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    assert tok.decode(tok.encode("abc")) == "abc"


def test_byte_load_rejects_bad_file(tmp_path):
    (tmp_path / BYTE_TOKENIZER_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="cannot read byte tokenizer file"):
        load_tokenizer(tmp_path)
    (tmp_path / BYTE_TOKENIZER_FILE).write_text(json.dumps({"type": "byte", "version": 2}))
    with pytest.raises(ValueError, match="version=2 is not supported"):
        load_tokenizer(tmp_path)


def test_byte_chat_template():
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert render_prompt(tok, msgs) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert render_prompt(tok, "plain text") == "plain text"


@pytest.mark.parametrize("bad, match", [
    ([], "non-empty list"),
    ([{"role": "user"}], r"message \[0\] must be a dict"),
    ([{"role": "user", "content": "a"}, "x"], r"message \[1\] must be a dict"),
])
def test_render_prompt_bad_messages(bad, match):
    with pytest.raises(ValueError, match=match):
        render_prompt(ByteTokenizer(), bad)


def test_render_prompt_bad_type():
    with pytest.raises(ValueError, match="must be a string or a list of .* got int"):
        render_prompt(ByteTokenizer(), 3)


def test_load_missing_and_empty_dirs(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ValueError) as e:
        load_tokenizer(tmp_path)
    msg = str(e.value)
    assert str(tmp_path) in msg and BYTE_TOKENIZER_FILE in msg and "tokenizer.json" in msg


def test_hf_tokenizer(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.eos_token_id == 2 and tok.pad_token_id == 1 and tok.vocab_size >= 200
    ids = tok.encode("The grass is green. 42")
    assert tok.decode(ids) == "The grass is green. 42"
    assert tok.decode(ids + [tok.eos_token_id]) == "The grass is green. 42"
    assert tok.decode(ids + [tok.vocab_size, 10**6]) == "The grass is green. 42"  # no token: nothing
    assert render_prompt(tok, [{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant] "
    out = hf_dir.parent / "resaved"
    tok.save(out)
    assert load_tokenizer(out).encode("The sky") == tok.encode("The sky")


def test_hf_without_chat_template(hf_dir, tmp_path):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    hf.chat_template = None
    hf.save_pretrained(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    tok = load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="has no chat template"):
        render_prompt(tok, [{"role": "user", "content": "hi"}])
    assert render_prompt(tok, "as is") == "as is"


def test_hf_pad_falls_back_to_eos():
    class Fake:
        eos_token_id, pad_token_id, bos_token_id = 7, None, None

    assert HFTokenizer(Fake()).pad_token_id == 7


def test_hf_broken_dir(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="cannot load the HF tokenizer in"):
        load_tokenizer(tmp_path)


def test_hf_needs_transformers(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ValueError, match=r"pip install longstraw\[hf\]"):
        load_tokenizer(tmp_path)


@pytest.fixture
def custom_dir(tmp_path):
    """A checkpoint directory whose tokenizer is its own Python code, laid out as Kimi's (``tokenizer_config.json``
    naming ``tokenization_chars.CharTokenizer`` in ``auto_map``, the vocabulary in ``tiktoken.model``, no
    ``tokenizer.json``): a character tokenizer, so nothing but transformers is needed."""
    pytest.importorskip("transformers")
    from custom_tokenizer import write_char_tokenizer

    d = tmp_path / "custom"
    d.mkdir()
    write_char_tokenizer(d)
    return d


def test_a_tokenizer_of_the_checkpoints_own_code_loads_only_when_trusted(custom_dir, tmp_path):
    with pytest.raises(ValueError, match=r"own code \(tokenization_chars\.py, .*model\.trust_remote_code = true.*"
                                         r"--trust-remote-code"):
        load_tokenizer(custom_dir)
    tok = load_tokenizer(custom_dir, trust_remote_code=True)
    ids = tok.encode("pass key 42")
    assert ids == [16, 1, 19, 19, 27, 11, 5, 25, 27, 32, 30] and tok.decode(ids) == "pass key 42"
    assert tok.eos_token_id == 38 and tok.vocab_size == 39
    assert tok.decode([16, 1, 39, 19, 300, -1, 19]) == "pass"  # ids past its table (a padded model vocabulary)
    tok.save(tmp_path / "saved")  # save_pretrained writes the code beside the vocabulary: it loads from there too
    assert load_tokenizer(tmp_path / "saved", trust_remote_code=True).encode("pass key 42") == ids


def test_an_exported_checkpoint_keeps_the_tokenizers_code_and_vocabulary(custom_dir):
    from longstraw.checkpoint.hf import tokenizer_files

    assert set(tokenizer_files(custom_dir)) == {"tokenizer_config.json", "tiktoken.model", "tokenization_chars.py"}


@pytest.mark.parametrize("auto_map, modules", [
    ({"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}, ["tokenization_kimi"]),  # Kimi-K2 / Linear
    ({"AutoTokenizer": "tokenization_kimi.TikTokenTokenizer"}, ["tokenization_kimi"]),
    ({"AutoTokenizer": ["tok.Slow", "tok.Fast"]}, ["tok"]),
    ({"AutoTokenizer": ["org/repo--tok.Slow", None]}, []),  # code in another repository: not in the directory
    ({"AutoConfig": "configuration_x.XConfig"}, []),
    ("not a dict", []),
])
def test_custom_tokenizer_modules_read_from_the_auto_map(tmp_path, auto_map, modules):
    from longstraw.tokenizer import custom_tokenizer_modules

    assert custom_tokenizer_modules(tmp_path) == []  # no tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map}))
    assert custom_tokenizer_modules(tmp_path) == modules
