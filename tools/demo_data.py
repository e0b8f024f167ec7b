"""The demo model's data: the CPython standard library as a corpus, and a byte-level BPE for it.

Used by tools/train_demo_model.py. The corpus is every ``*.py`` file of a stdlib folder (PSF
license), sorted by relative path; a file is held out when a hash of its path says so, so the
split does not depend on the order files are found in or on which other files exist. A corpus
can be written to one JSON-lines file (gzip when the name ends in ``.gz``) and carried to the
machine that trains, so the training machine's own Python does not matter.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import platform
import sysconfig
from collections.abc import Iterator
from typing import Any, TextIO

EOT = "<|endoftext|>"  # separates documents; also the BOS, EOS and padding token
# generated or non-code files: the charmap tables of encodings/ and pydoc's 750 kB topics string
EXCLUDED_DIRS = ("site-packages", "pydoc_data", "encodings")
HELDOUT_PERCENT = 2

# The model completes Python source, so a conversation is rendered as a source file: system and
# user messages become comment lines and assistant messages are code. The generation prompt is
# empty, because the assistant's reply is simply what the file continues with.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ m['content'] }}\n"
    "{% else %}{% for line in m['content'].split('\\n') %}# {{ line }}\n{% endfor %}"
    "{% endif %}{% endfor %}"
)


def default_stdlib() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(relpath: str) -> bool:
    """Stable across machines and Python versions (not ``hash()``, which is salted)."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def iter_stdlib(stdlib: str) -> Iterator[tuple[str, str]]:
    """(relative path with '/', text) of each UTF-8 ``*.py`` file, sorted by path.

    The few files in other encodings (encoding tests) are skipped rather than guessed at.
    """
    paths = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel_dir = os.path.relpath(dirpath, stdlib)
        dirnames[:] = [d for d in dirnames
                       if not (rel_dir == "." and d in EXCLUDED_DIRS) and d != "__pycache__"]
        paths += [os.path.normpath(os.path.join(rel_dir, f)).replace(os.sep, "/")
                  for f in filenames if f.endswith(".py")]
    for rel in sorted(paths):
        with open(os.path.join(stdlib, rel), "rb") as f:
            data = f.read()
        try:
            yield rel, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def _open_text(path: str) -> TextIO:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")  # type: ignore[return-value]
    return open(path, encoding="utf-8")


def build_corpus(stdlib: str) -> dict[str, Any]:
    """{"meta": where it came from, "docs": [{"path", "text"}]}."""
    docs = [{"path": rel, "text": text} for rel, text in iter_stdlib(stdlib)]
    if not docs:
        raise ValueError(f"no *.py files under {stdlib!r}; pass --stdlib with a Python "
                         "standard library folder")
    meta = {"source": "CPython standard library (*.py), PSF License Agreement",
            "python_version": platform.python_version(), "stdlib": stdlib,
            "excluded_dirs": list(EXCLUDED_DIRS), "heldout_percent": HELDOUT_PERCENT}
    return {"meta": meta, "docs": docs}


def write_corpus(corpus: dict[str, Any], path: str) -> None:
    """One JSON object a line: the meta record first, then one per file."""
    with open(path, "wb") as raw:
        stream: Any = raw
        if path.endswith(".gz"):  # no name or time in the header: same corpus, same bytes
            stream = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0)
        with io.TextIOWrapper(stream, encoding="utf-8") as f:
            f.write(json.dumps({"meta": corpus["meta"]}) + "\n")
            for doc in corpus["docs"]:
                f.write(json.dumps(doc) + "\n")


def read_corpus(path: str) -> dict[str, Any]:
    with _open_text(path) as f:
        meta = json.loads(f.readline())["meta"]
        docs = [json.loads(line) for line in f if line.strip()]
    return {"meta": meta, "docs": docs}


def split(corpus: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts), each in path order."""
    train = [d["text"] for d in corpus["docs"] if not is_heldout(d["path"])]
    heldout = [d["text"] for d in corpus["docs"] if is_heldout(d["path"])]
    if not train or not heldout:
        raise ValueError(f"corpus of {len(corpus['docs'])} files leaves an empty split "
                         f"({len(train)} train, {len(heldout)} held out); use a larger stdlib")
    return train, heldout


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE (GPT-2 style pre-tokenizer, no prefix space) that prepends EOT.

    Every training document starts after an EOT, so a prompt encoded with the EOT in front is
    read as the start of a file, which is what a user's prompt usually is.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    eot = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot)])
    return tok


def tokenizer_config(max_len: int) -> dict[str, Any]:
    """tokenizer_config.json, written by hand so its contents do not depend on the version of
    transformers that saves it (newer ones move the chat template to a separate file)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
            "pad_token": EOT, "unk_token": None, "model_max_length": max_len,
            "clean_up_tokenization_spaces": False, "add_prefix_space": False,
            "chat_template": CHAT_TEMPLATE}


def encode_stream(tok: Any, texts: list[str]) -> Any:
    """All texts as one uint16 array: EOT doc EOT doc ... (the post-processor adds each EOT)."""
    import numpy as np

    if tok.get_vocab_size() > 65536:
        raise ValueError(f"vocab size {tok.get_vocab_size()} does not fit uint16")
    parts = [np.asarray(e.ids, dtype=np.uint16) for e in tok.encode_batch(texts)]
    return np.concatenate(parts)
