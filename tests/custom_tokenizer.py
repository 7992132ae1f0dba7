"""A stand-in for a tokenizer that is a checkpoint's own Python code, laid out as Kimi's (Kimi-K2, K2.5/K2.6,
Kimi-Linear: ``tokenizer_config.json`` naming ``tokenization_kimi.TikTokenTokenizer`` in its ``auto_map``, the
vocabulary in ``tiktoken.model``, no ``tokenizer.json``): a character tokenizer over 39 symbols, so that nothing but
transformers is needed (Kimi's own needs tiktoken and its 2.8 MB rank file)."""

import json
from pathlib import Path

CHARS = ["?", *"abcdefghijklmnopqrstuvwxyz 0123456789", "<eos>"]  # ids 0..38; "<eos>" is 38

SOURCE = '''
import json, os
from transformers import PreTrainedTokenizer


class CharTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}  # the file name Kimi's tokenizer reads its ranks from

    def __init__(self, vocab_file, **kwargs):
        with open(vocab_file, encoding="utf-8") as f:
            self.chars = json.load(f)
        self.ids = {c: i for i, c in enumerate(self.chars)}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.chars)

    def get_vocab(self):
        return {**self.ids, **self.added_tokens_encoder}

    def _tokenize(self, text):
        return list(text)

    def _convert_token_to_id(self, token):
        return self.ids.get(token, 0)

    def _convert_id_to_token(self, index):
        return self.chars[index]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        path = os.path.join(save_directory, (filename_prefix or "") + "tiktoken.model")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.chars, f)
        return (path,)
'''


def write_char_tokenizer(d: Path) -> None:
    """Write the tokenizer's code (``tokenization_chars.py``), vocabulary (``tiktoken.model``) and
    ``tokenizer_config.json`` into directory ``d``."""
    d = Path(d)
    (d / "tokenization_chars.py").write_text(SOURCE)
    (d / "tiktoken.model").write_text(json.dumps(CHARS))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "CharTokenizer", "eos_token": "<eos>",
        "auto_map": {"AutoTokenizer": ["tokenization_chars.CharTokenizer", None]}}))
