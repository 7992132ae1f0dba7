"""Tokenizers: a small protocol, a built-in byte tokenizer, and HF tokenizers wrapped to the same protocol.

Why a protocol: the trainer, rollouts, tasks and CLI need only ``encode``, ``decode``, a few special ids, a chat
template and ``save``. Keeping that surface small lets the built-in demo run with no ``transformers`` installed
(:class:`ByteTokenizer`), while real checkpoints use their own HF tokenizer through :class:`HFTokenizer`.

Conventions (both implementations):

- ``encode(text)`` adds NO special tokens: a rendered chat template already contains its own BOS/role tokens, and a
  plain-string prompt is used exactly as given.
- ``decode(ids)`` drops special tokens by default and never raises on invalid UTF-8 (byte tokenizer: invalid byte
  sequences become U+FFFD, ``errors="replace"``), because sampled responses are arbitrary id sequences.
- ``apply_chat_template(messages)`` returns the rendered prompt TEXT with the generation prompt appended; encode
  it with ``encode``. :func:`render_prompt` accepts either a string (used as is) or a list of messages.

The byte tokenizer's ids: ``0..255`` are the raw UTF-8 bytes, ``256`` = BOS, ``257`` = EOS, ``258`` = PAD;
``vocab_size`` = 259. Its file is ``longstraw_tokenizer.json`` (see :data:`BYTE_TOKENIZER_FILE`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, Union, runtime_checkable

Message = dict  # {"role": str, "content": str}
Prompt = Union[str, list]  # a plain string, or a list of messages

BYTE_TOKENIZER_FILE = "longstraw_tokenizer.json"
# files whose presence marks a directory as holding an HF tokenizer
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                      "spiece.model", "tiktoken.model")


@runtime_checkable
class Tokenizer(Protocol):
    """What LongStraw needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def pad_token_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[Message]) -> str: ...

    def save(self, directory: str | Path) -> None: ...


def _check_messages(messages) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"a chat prompt must be a non-empty list of {{'role', 'content'}} messages, got {messages!r:.200}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message [{i}] must be a dict with string 'role' and 'content', got {m!r:.200}")
    return messages


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255) plus BOS=256, EOS=257, PAD=258.

    The built-in chat template (documented, deliberately plain)::

        <|role|>\\n{content}\\n      for every message, then
        <|assistant|>\\n            as the generation prompt

    where ``<|role|>`` is the literal text (e.g. ``<|user|>``), encoded as bytes like everything else.
    """

    NUM_BYTES = 256
    BOS = 256
    EOS = 257
    PAD = 258

    def __init__(self) -> None:
        self._specials = {self.BOS: "<|bos|>", self.EOS: "<|eos|>", self.PAD: "<|pad|>"}

    # protocol ---------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def bos_token_id(self) -> int:
        return self.BOS

    @property
    def eos_token_id(self) -> int:
        return self.EOS

    @property
    def pad_token_id(self) -> int:
        return self.PAD

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode needs a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the byte tokenizer's vocabulary [0, {self.vocab_size})")
        if not any(i >= self.NUM_BYTES for i in ids):
            return bytes(ids).decode("utf-8", errors="replace")
        out, run = [], []
        for i in ids:
            if i < self.NUM_BYTES:
                run.append(i)
                continue
            out.append(bytes(run).decode("utf-8", errors="replace"))
            run = []
            if not skip_special_tokens:
                out.append(self._specials[i])
        out.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[Message]) -> str:
        _check_messages(messages)
        return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / BYTE_TOKENIZER_FILE).write_text(json.dumps(
            {"type": "byte", "version": 1, "vocab_size": self.vocab_size, "bos_token_id": self.BOS,
             "eos_token_id": self.EOS, "pad_token_id": self.PAD}, indent=1) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "ByteTokenizer":
        p = Path(directory) / BYTE_TOKENIZER_FILE
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read byte tokenizer file {str(p)!r}: {e}") from None
        tok = cls()
        want = {"type": "byte", "version": 1, "vocab_size": tok.vocab_size, "bos_token_id": tok.BOS,
                "eos_token_id": tok.EOS, "pad_token_id": tok.PAD}
        if not isinstance(d, dict):
            raise ValueError(f"{p}: expected a JSON object, got {d!r:.100}")
        for k, v in want.items():
            if d.get(k) != v:
                raise ValueError(f"{p}: {k}={d.get(k)!r} is not supported (this version writes {k}={v!r})")
        return tok

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259, bos=256, eos=257, pad=258)"


class HFTokenizer:
    """A ``transformers`` tokenizer wrapped to the :class:`Tokenizer` protocol.

    ``vocab_size`` is ``len(tokenizer)`` (base vocabulary plus added tokens). ``pad_token_id`` falls back to the EOS
    id when the tokenizer defines no pad token (common for decoder-only checkpoints).
    """

    def __init__(self, hf_tokenizer, source: str = "") -> None:
        self.hf = hf_tokenizer
        self.source = source

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id if self.hf.pad_token_id is not None else self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode needs a str, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids the tokenizer has no token for (``< 0`` or ``>= vocab_size``: a model's vocabulary padded past its
        tokenizer's, as Kimi's 163,840 rows over 163,600 tokens, which a sampler can still draw) decode to nothing,
        as fast tokenizers skip them; a Python tokenizer indexing its own table would raise."""
        n = len(self.hf)
        return self.hf.decode([int(i) for i in ids if 0 <= int(i) < n], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[Message]) -> str:
        _check_messages(messages)
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"the tokenizer at {self.source!r} has no chat template: give the prompt as a plain "
                             "string instead of a list of messages")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def save(self, directory: str | Path) -> None:
        self.hf.save_pretrained(str(directory))

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size}, source={self.source!r})"


def custom_tokenizer_modules(directory: str | Path) -> list[str]:
    """The Python modules of a checkpoint's own tokenizer code: what ``tokenizer_config.json``'s ``auto_map``
    names for ``AutoTokenizer`` (``"tokenization_kimi.TikTokenTokenizer"`` -> ``"tokenization_kimi"``, as Kimi-K2,
    K2.5/K2.6 and Kimi-Linear ship their tiktoken tokenizer), in that order; empty if there is none. Entries that
    point into another repository (``"org/repo--module.Class"``) are not in the directory and are left out."""
    f = Path(directory) / "tokenizer_config.json"
    try:
        auto = json.loads(f.read_text(encoding="utf-8")).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return []
    refs = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
    refs = [refs] if isinstance(refs, str) else refs if isinstance(refs, list) else []
    out = []
    for r in refs:
        if isinstance(r, str) and "--" not in r and "." in r:
            module = r.rsplit(".", 1)[0]
            if module not in out:
                out.append(module)
    return out


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> ByteTokenizer | HFTokenizer:
    """The tokenizer saved in directory ``path``.

    ``longstraw_tokenizer.json`` present: the built-in byte tokenizer. Otherwise any HF tokenizer file
    (``tokenizer.json``, ``tokenizer_config.json``, ``tiktoken.model``, ...): ``AutoTokenizer.from_pretrained(path,
    local_files_only=True)``, wrapped (nothing is downloaded). Anything else is a ValueError naming the path and the
    files looked for.

    ``trust_remote_code``: a tokenizer that is the checkpoint's own Python code (``tokenizer_config.json``'s
    ``auto_map``, e.g. Kimi's ``tokenization_kimi.TikTokenTokenizer``, which also needs ``pip install tiktoken``)
    is imported from the directory only when this is true (``model.trust_remote_code``, the CLI's
    ``--trust-remote-code``); without it such a tokenizer is a ValueError naming the module and the option. A
    tokenizer that transformers can load without the code (a ``tokenizer.json`` beside an ``auto_map``) loads
    without it either way.
    """
    d = Path(path)
    if not d.is_dir():
        raise ValueError(f"tokenizer path {str(d)!r} is not a directory")
    if (d / BYTE_TOKENIZER_FILE).is_file():
        return ByteTokenizer.load(d)
    if not any((d / f).is_file() for f in HF_TOKENIZER_FILES):
        raise ValueError(f"no tokenizer in {str(d)!r}: looked for {BYTE_TOKENIZER_FILE} (built-in byte tokenizer) "
                         f"and the HF tokenizer files {', '.join(HF_TOKENIZER_FILES)}")
    try:
        import transformers
    except ImportError:
        raise ValueError(f"the tokenizer in {str(d)!r} is an HF tokenizer, which needs transformers: "
                         "pip install longstraw[hf]") from None
    custom = custom_tokenizer_modules(d)
    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True,
                                                        trust_remote_code=bool(trust_remote_code))
    except Exception as e:  # transformers raises OSError/ValueError/KeyError... for broken directories
        if custom and not trust_remote_code:
            files = ", ".join(m + ".py" for m in custom)
            raise ValueError(f"the tokenizer in {str(d)!r} is the checkpoint's own code ({files}, named by "
                             "tokenizer_config.json's auto_map): LongStraw imports it only when told to: "
                             "model.trust_remote_code = true in a run config, --trust-remote-code on the command "
                             "line, load_tokenizer(..., trust_remote_code=True); read that file first") from None
        raise ValueError(f"cannot load the HF tokenizer in {str(d)!r}: {type(e).__name__}: {e}") from None
    return HFTokenizer(hf, source=str(d))


def render_prompt(tokenizer: Tokenizer, prompt: Prompt) -> str:
    """A prompt as text: a string is used as is; a list of ``{"role", "content"}`` messages is rendered with the
    tokenizer's chat template and the generation prompt appended (byte tokenizer: its built-in template)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(_check_messages(prompt))
    raise ValueError(f"a prompt must be a string or a list of {{'role', 'content'}} messages, "
                     f"got {type(prompt).__name__}")
