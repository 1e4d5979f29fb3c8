"""The tokenizer side of a Hugging Face export: what a checkpoint carries of its data's tokenizer
(gdn_parallel/data/tokenizer_record.py) written the way transformers reads it, and the check that
a folder converted into a checkpoint goes with data made by its tokenizer.

An export of a checkpoint whose data was made by a `tokenizers` file holds

    tokenizer.json          the checkpoint's copy, verbatim
    tokenizer_config.json   tokenizer_class PreTrainedTokenizerFast and the bos / eos / pad tokens
    generation_config.json  their ids (also in config.json as bos_token_id, eos_token_id, pad_token_id)

Byte-level data (ids are the UTF-8 bytes of the text, vocabulary 256) has no tokenizer file that
transformers could load: the export holds no tokenizer files, generation_config.json and config.json
give null token ids, and config.json's `gdn_parallel.tokenizer` says {"kind": "bytes"}. A checkpoint
that records no tokenizer (saved before checkpoints carried one, or data that records none) is
exported the same way with `gdn_parallel.tokenizer` null.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..data.text_tokenizer import SPECIAL_ROLES
from ..data.tokenizer_record import TOKENIZER_INFO, TOKENIZER_JSON
from .errors import ConvertError

TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CLASS = "PreTrainedTokenizerFast"   # transformers' tokenizer over a tokenizer.json (v4 and v5)
# bos_token -> bos_token_id
ID_FIELDS = {role: role.replace("_token", "_token_id") for role in SPECIAL_ROLES}


def read_checkpoint_tokenizer(checkpoint: Path) -> tuple[dict | None, bytes | None]:
    """(the tokenizer's identity, its tokenizer.json bytes) that a checkpoint carries; (None, None)
    when it carries none, (identity, None) for byte-level data."""
    info_path = Path(checkpoint) / TOKENIZER_INFO
    if not info_path.is_file():
        return None, None
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConvertError(f"{info_path} cannot be read ({err}); take another checkpoint") from None
    if not isinstance(info, dict) or info.get("kind") not in ("bytes", "tokenizers"):
        raise ConvertError(f"{info_path} is not a tokenizer record (kind 'bytes' or 'tokenizers'); take "
                           f"another checkpoint")
    if info["kind"] == "bytes":
        return info, None
    data_path = Path(checkpoint) / TOKENIZER_JSON
    if not data_path.is_file():
        raise ConvertError(f"{checkpoint} records a tokenizer ({TOKENIZER_INFO}) but lacks its "
                           f"{TOKENIZER_JSON}; copy the whole checkpoint directory")
    data = data_path.read_bytes()
    if hashlib.sha256(data).hexdigest() != info.get("sha256"):
        raise ConvertError(f"{data_path} is not the tokenizer {info_path} records (sha256 differs); take "
                           f"another checkpoint")
    return info, data


def carried_files(checkpoint: Path) -> dict[str, bytes]:
    """The tokenizer files a checkpoint carries, as they are (for a checkpoint saved again elsewhere)."""
    return {name: (Path(checkpoint) / name).read_bytes() for name in (TOKENIZER_INFO, TOKENIZER_JSON)
            if (Path(checkpoint) / name).is_file()}


def special_token_ids(info: dict | None) -> dict[str, int | None]:
    """config.json's bos_token_id / eos_token_id / pad_token_id (null where there is no such token)."""
    tokens = (info or {}).get("special_tokens") or {}
    return {field: (tokens.get(role) or {}).get("id") for role, field in ID_FIELDS.items()}


def check_special_ids(info: dict | None, vocab_size: int, where: str) -> None:
    for role, field in ID_FIELDS.items():
        token_id = special_token_ids(info)[field]
        if token_id is not None and token_id >= vocab_size:
            raise ConvertError(f"{where}: the tokenizer's {role} has id {token_id}, outside the model's "
                               f"vocabulary of {vocab_size} (model.vocab_size): no export could generate or "
                               f"read it")


def write_tokenizer_files(folder: Path, info: dict | None, tokenizer_json: bytes | None) -> list[str]:
    """tokenizer.json and tokenizer_config.json (a tokenizers tokenizer only), and generation_config.json
    (always); returns the names written."""
    ids = special_token_ids(info)
    (folder / GENERATION_CONFIG).write_text(json.dumps(ids, indent=2) + "\n", encoding="utf-8")
    if tokenizer_json is None:
        return [GENERATION_CONFIG]
    (folder / TOKENIZER_JSON).write_bytes(tokenizer_json)
    tokens = info.get("special_tokens") or {}
    config = {"tokenizer_class": TOKENIZER_CLASS, "clean_up_tokenization_spaces": False,
              **{role: (tokens.get(role) or {}).get("content") for role in SPECIAL_ROLES}}
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return [TOKENIZER_JSON, TOKENIZER_CONFIG, GENERATION_CONFIG]


def describe(info: dict | None) -> str:
    """One line on what tokenizer an export holds."""
    if info is None:
        return "tokenizer: none (the checkpoint records none: saved before checkpoints carried one, or its " \
               "data records none); no tokenizer files, token ids null"
    if info["kind"] == "bytes":
        return ("tokenizer: byte-level data (ids are UTF-8 bytes, vocabulary 256): no tokenizer files, token "
                "ids null")
    tokens = info.get("special_tokens") or {}
    named = ", ".join(f"{role.split('_')[0]} {tokens[role]['content']!r} = {tokens[role]['id']}"
                      if tokens.get(role) else f"{role.split('_')[0]} none" for role in SPECIAL_ROLES)
    return f"tokenizer: {TOKENIZER_JSON}, {TOKENIZER_CONFIG}, {GENERATION_CONFIG} ({named})"


def folder_tokenizer(folder: Path, hf: dict, embedded_key: str) -> dict | None:
    """What made a Hugging Face folder's ids, as far as it says: our export's record (config.json),
    else the sha256 of its tokenizer.json; None when it says nothing."""
    embedded = hf.get(embedded_key)
    if isinstance(embedded, dict) and isinstance(embedded.get("tokenizer"), dict):
        return embedded["tokenizer"]
    local = Path(folder) / TOKENIZER_JSON
    if local.is_file():
        return {"kind": "tokenizers", "sha256": hashlib.sha256(local.read_bytes()).hexdigest()}
    return None


def require_same_tokenizer(folder_info: dict | None, data_info: dict | None, folder: str, data: str) -> None:
    """A folder's weights trained on ids of one tokenizer go on with data made by the same one (when
    both say which)."""
    if folder_info is None or data_info is None:
        return
    same = folder_info.get("kind") == data_info.get("kind") and (
        folder_info["kind"] == "bytes" or folder_info.get("sha256") == data_info.get("sha256"))
    if not same:
        def named(info):
            if info.get("kind") == "bytes":
                return "byte-level ids"
            return f"tokenizer.json sha256 {str(info.get('sha256'))[:12]}"
        fix = ("byte-level data (text files, or gdn-prepare-data --tokenizer bytes)"
               if folder_info["kind"] == "bytes" else
               f"data prepared by the folder's tokenizer "
               f"(gdn-prepare-data --tokenizer {folder}/{TOKENIZER_JSON})")
        raise ConvertError(f"{folder} was trained on {named(folder_info)} but the new checkpoint's data "
                           f"({data}) is {named(data_info)}: give --config (or --set data.source=...) "
                           f"with {fix}")
