"""Tokenizers for the offline corpora: a byte-level BPE trained here, and raw bytes.

``get_tokenizer()`` returns a byte-level BPE (GPT-2 style: no normalisation, so
``decode(encode(text)) == text`` for any string) trained with the ``tokenizers`` package
on the train split of a corpus (``shakespeare`` by default). Training the 4096-token
vocabulary on the ~4.3 MB train split takes a few seconds on two CPU cores, so the full
split is used. The trained tokenizer is saved as JSON under a cache folder and loaded
from there on the next call; the file name carries the corpus, the vocabulary size,
``TOKENIZER_VERSION`` and a digest of the training text, so a change to any of them
trains a new file instead of reusing a stale one.

``get_tokenizer(kind="byte")`` returns the byte tokenizer: ids 0..255 are the UTF-8
bytes, 256 is the end-of-document token. It needs no training (fast tests).

Cache folder: the ``cache_dir`` argument, else ``$OCCULT_CACHE/tokenizers``, else
``<repo>/runs/cache/tokenizers``. Token-id caches (``occult.data.batches``) sit next to
the tokenizer file.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from occult.data.corpora import atomic_write_bytes, cache_root, check_corpus, split_documents

TOKENIZER_KINDS = ("bpe", "byte")
TOKENIZER_VERSION = "v1"
EOT = "<|endoftext|>"                       # end-of-document token, appended after each document
NUM_BYTES = 256

def tokenizer_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder for tokenizer files: ``cache_dir`` if given, else ``cache_root()/tokenizers``."""
    return Path(cache_dir) if cache_dir is not None else cache_root() / "tokenizers"


def text_digest(texts) -> str:
    """First 12 hex digits of the SHA-256 of the texts (each length-prefixed)."""
    h = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:12]


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, ``eot_id`` = 256 ends a document."""

    def __init__(self, cache_dir: Path | None = None):
        self.name = f"byte-{TOKENIZER_VERSION}"
        self.vocab_size = NUM_BYTES + 1
        self.eot_id = NUM_BYTES
        self.cache_dir = cache_dir
        self.loaded_from_cache = False
        self.train_seconds = 0.0

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (one per UTF-8 byte); the text ``EOT`` is not special here."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text."""
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        """Text of token ids; ``eot_id`` becomes ``EOT``, invalid UTF-8 becomes U+FFFD."""
        out, run = [], bytearray()
        for i in map(int, ids):
            if i == self.eot_id:
                out.append(run.decode("utf-8", errors="replace") + EOT)
                run = bytearray()
            elif 0 <= i < NUM_BYTES:
                run.append(i)
            else:
                raise ValueError(f"token id {i}: allowed values are 0..{self.vocab_size - 1}")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class BPETokenizer:
    """Byte-level BPE (a trained ``tokenizers.Tokenizer``) with ``EOT`` as its special
    token; ``vocab_size`` counts every id, the special one included."""

    def __init__(self, tokenizer, name: str, cache_dir: Path | None,
                 loaded_from_cache: bool, train_seconds: float):
        self._tok = tokenizer
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size()
        self.eot_id = tokenizer.token_to_id(EOT)
        self.cache_dir = cache_dir
        self.loaded_from_cache = loaded_from_cache
        self.train_seconds = train_seconds

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; a literal ``EOT`` in the text maps to ``eot_id``."""
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text, in parallel inside ``tokenizers``."""
        return [enc.ids for enc in self._tok.encode_batch(list(texts))]

    def decode(self, ids) -> str:
        """Text of token ids (special tokens kept, so the round trip is exact)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def train_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` ids trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _check_vocab_size(vocab_size) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < NUM_BYTES + 1:
        raise ValueError(f"vocab_size={vocab_size!r}: allowed values are integers >= {NUM_BYTES + 1} "
                         f"({NUM_BYTES} byte symbols + the {EOT} token)")


def get_tokenizer(vocab_size: int = 4096, cache_dir: str | os.PathLike | None = None,
                  kind: str = "bpe", corpus: str = "shakespeare") -> BPETokenizer | ByteTokenizer:
    """The tokenizer ``kind`` (``"bpe"`` or ``"byte"``), loaded from the cache if present.

    ``bpe``: trained on the train split of ``corpus`` with ``vocab_size`` ids and saved as
    ``<cache>/<corpus>-bpe<vocab_size>-<TOKENIZER_VERSION>-<digest>.json``.
    ``byte``: ``vocab_size`` and ``corpus`` are ignored (257 ids, no training).
    The result has ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``,
    ``eot_id``, ``name`` (used to key token caches), ``cache_dir`` and
    ``loaded_from_cache``.
    """
    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"kind={kind!r}: allowed values are {list(TOKENIZER_KINDS)}")
    folder = tokenizer_dir(cache_dir)
    if kind == "byte":
        return ByteTokenizer(cache_dir=folder)
    _check_vocab_size(vocab_size)
    check_corpus(corpus)
    from tokenizers import Tokenizer

    texts = list(split_documents(corpus, "train").values())
    name = f"{corpus}-bpe{vocab_size}-{TOKENIZER_VERSION}-{text_digest(texts)}"
    path = folder / f"{name}.json"
    if path.exists():
        return BPETokenizer(Tokenizer.from_file(str(path)), name, folder,
                            loaded_from_cache=True, train_seconds=0.0)
    start = time.perf_counter()
    tok = train_bpe(texts, vocab_size)
    seconds = time.perf_counter() - start
    atomic_write_bytes(path, tok.to_str().encode("utf-8"))
    return BPETokenizer(tok, name, folder, loaded_from_cache=False, train_seconds=seconds)
