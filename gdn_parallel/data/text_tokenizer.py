"""Text to token ids for prepare.py (gdn-prepare-data): raw UTF-8 bytes, or a local Hugging Face `tokenizers`
tokenizer file (tokenizer.json). `tokenizers` is imported only when a file is given.

A file tokenizer also says which UTF-8 bytes of a document each token stands for
(`encode_joined`, text_bytes_per_token: what val_bpb divides by) and names its special tokens (bos, eos, pad:
`special_tokens`, what a Hugging Face export declares)."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from itertools import chain
from operator import itemgetter
from pathlib import Path

import numpy as np

from ..config import BYTE_VOCAB_SIZE

BYTES = "bytes"
SPECIAL_ROLES = ("bos_token", "eos_token", "pad_token")
HF_TOKENIZER_CONFIG = "tokenizer_config.json"   # transformers' file beside a tokenizer.json
# encode_joined: (every document's ids back to back, each document's token count, each token's text
# bytes back to back or None where every token is one byte); one array per batch, not per document
Joined = tuple[np.ndarray, np.ndarray, np.ndarray | None]


class ByteTokenizer:
    """The UTF-8 bytes of the text: the same ids data.source reads from text files."""
    vocab_size = BYTE_VOCAB_SIZE
    one_byte_per_token = True

    def identity(self) -> dict:
        return {"kind": BYTES, "vocab_size": self.vocab_size}

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def encode_joined(self, texts: Sequence[str]) -> Joined:
        encoded = [text.encode("utf-8") for text in texts]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        return np.frombuffer(b"".join(encoded), dtype=np.uint8), lengths, None


class FileTokenizer:
    """A `tokenizers` tokenizer saved as JSON; its own post-processing (special tokens) applies.
    `special`: role -> token text given on the command line (--bos-token ...), over what the files say."""
    one_byte_per_token = False

    def __init__(self, path: str, special: dict[str, str | None] | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(f"--tokenizer {path} needs the `tokenizers` package: pip install tokenizers "
                             f"(or use --tokenizer bytes)") from None
        file = Path(path).expanduser()
        if not file.is_file():
            raise ValueError(f"--tokenizer {path}: no such file; give a tokenizer.json or 'bytes'")
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as err:  # the library raises its own Exception type for a bad file
            raise ValueError(f"--tokenizer {path} is not a tokenizers JSON file ({err})") from None
        self.path = str(file.resolve())
        self.sha256 = hashlib.sha256(file.read_bytes()).hexdigest()
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        self.special_tokens = self._special_tokens(file, special or {})

    def identity(self) -> dict:
        return {"kind": "tokenizers", "file": self.path, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "special_tokens": self.special_tokens}

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(encoding.ids, dtype=np.int64)
                for encoding in self._tokenizer.encode_batch(list(texts))]

    def encode_joined(self, texts: Sequence[str]) -> Joined:
        """The batch's ids, token counts and UTF-8 bytes each token stands for (text_bytes_per_token),
        each joined into one array: per-document arrays would cost more than the ids themselves."""
        encodings = self._tokenizer.encode_batch(list(texts))
        id_lists = [encoding.ids for encoding in encodings]
        lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
        ids = np.fromiter(chain.from_iterable(id_lists), dtype=np.uint32, count=int(lengths.sum()))
        counts = [text_bytes_per_token(text, encoding.offsets) for text, encoding in zip(texts, encodings)]
        return ids, lengths, np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)

    def _special_tokens(self, file: Path, given: dict[str, str | None]) -> dict[str, dict | None]:
        """role -> {"content", "id", "from"} or None, each from the first that names it: the command
        line, transformers' tokenizer_config.json beside the file, the post-processor's template
        (the token before the text is bos, the one after it eos)."""
        found: dict[str, tuple[str, str]] = {}
        for role, content in _template_specials(json.loads(file.read_text(encoding="utf-8"))).items():
            found[role] = (content, "the tokenizer's post-processor template")
        beside = file.with_name(HF_TOKENIZER_CONFIG)
        for role, content in _hf_config_specials(beside).items():
            found[role] = (content, str(beside))
        for role, given_content in given.items():
            if given_content is not None:
                found[role] = (given_content, f"--{role.replace('_', '-')}")
        tokens: dict[str, dict | None] = {role: None for role in SPECIAL_ROLES}
        for role, (content, origin) in found.items():
            token_id = self._tokenizer.token_to_id(content)
            if token_id is None:
                raise ValueError(f"{role} {content!r} (from {origin}) is not a token of --tokenizer "
                                 f"{self.path}; give --{role.replace('_', '-')} with one of its tokens")
            tokens[role] = {"content": content, "id": int(token_id), "from": origin}
        return tokens


def _template_specials(tokenizer_json: dict) -> dict[str, str]:
    """bos/eos of a TemplateProcessing post-processor (also inside a Sequence of processors)."""
    processor = tokenizer_json.get("post_processor") or {}
    processors = processor.get("processors", []) if processor.get("type") == "Sequence" else [processor]
    for candidate in processors:
        single = candidate.get("single") if isinstance(candidate, dict) else None
        if candidate.get("type") != "TemplateProcessing" or not single:
            continue
        kinds = [next(iter(piece)) for piece in single]
        if "Sequence" not in kinds:
            continue
        first, last = kinds.index("Sequence"), len(kinds) - 1 - kinds[::-1].index("Sequence")
        named = candidate.get("special_tokens") or {}

        # a template names a special token; its map gives the token
        def content(piece: dict, named: dict = named) -> str:
            name = piece["SpecialToken"]["id"]
            tokens = (named.get(name) or {}).get("tokens") or [name]
            return tokens[0] if len(tokens) == 1 else name
        found = {}
        if first > 0 and kinds[first - 1] == "SpecialToken":
            found["bos_token"] = content(single[first - 1])
        if last + 1 < len(kinds) and kinds[last + 1] == "SpecialToken":
            found["eos_token"] = content(single[last + 1])
        return found
    return {}


def _hf_config_specials(path: Path) -> dict[str, str]:
    """bos/eos/pad named by a transformers tokenizer_config.json (a string, or {"content": ...})."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} (read for the special tokens) is not JSON ({err}); "
                         f"fix or remove it") from None
    found = {}
    for role in SPECIAL_ROLES:
        value = config.get(role) if isinstance(config, dict) else None
        content = value.get("content") if isinstance(value, dict) else value
        if isinstance(content, str):
            found[role] = content
    return found


def text_bytes_per_token(text: str, offsets: Sequence[tuple[int, int]]) -> np.ndarray:
    """The UTF-8 bytes of `text` each token stands for, from the tokens' character offsets: every byte
    counted once, by the first token whose end reaches past it; text after the last end goes to the
    token that reached it (or the first). Tokens that reach no new text get 0: special tokens a
    post-processor adds, the later pieces of a character that byte-level BPE splits. The counts add
    up to len(text.encode('utf-8')) for every document."""
    if not offsets:
        return np.zeros(0, dtype=np.int64)
    ends = np.fromiter(map(itemgetter(1), offsets), dtype=np.int64, count=len(offsets))
    if text.isascii():   # a character is a byte: the offsets are byte positions already
        num_bytes = len(text)
    else:
        points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        widths = 1 + (points >= 0x80).astype(np.int64) + (points >= 0x800) + (points >= 0x10000)
        byte_at = np.concatenate([[0], np.cumsum(widths)])
        num_bytes, ends = int(byte_at[-1]), byte_at[ends]
    reached = np.maximum.accumulate(ends)
    counts = np.diff(reached, prepend=0)
    counts[int(np.argmax(reached == reached[-1]))] += num_bytes - int(reached[-1])
    return counts


def load_tokenizer(spec: str, special: dict[str, str | None] | None = None):
    """'bytes' or the path of a tokenizers JSON file (`special`: FileTokenizer's)."""
    if spec == BYTES:
        if special and any(special.values()):
            raise ValueError("--bos-token / --eos-token / --pad-token name tokens of a --tokenizer file; "
                             "byte-level data (--tokenizer bytes) has no special tokens")
        return ByteTokenizer()
    return FileTokenizer(spec, special)
