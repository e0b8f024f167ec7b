"""Compiles guided-decoding grammars against the tokenizer on a worker thread, cached by
constraint, so a never-seen schema does not stall the requests already running."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedllm import envs
from pagedllm.engine.guided.validate import parse_grammar
from pagedllm.sampling_params import GuidedDecodingParams

logger = logging.getLogger(__name__)

CACHE_ENTRIES = 1024


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary, with the tokenizer's special tokens (BOS, UNK, pad:
    text a detokenizer drops) as empty strings, which xgrammar never allows; the stop tokens
    stay allowed where the grammar may end."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=stop_token_ids or None)
    special = set(getattr(tokenizer, "all_special_ids", ())) - set(stop_token_ids)
    vocab = list(info.decoded_vocab)
    if not any(t < len(vocab) and vocab[t] for t in special):
        return info
    for t in special:
        if t < len(vocab):
            vocab[t] = b""
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids or None,
                             add_prefix_space=info.add_prefix_space)


class GrammarCompileError(ValueError):
    """A grammar that failed to compile or took longer than the timeout."""


class GrammarCompilerService:
    """One xgrammar compiler for the engine's tokenizer; ``submit`` returns a Future of the
    ``CompiledGrammar`` (the same Future for an equal constraint while it is cached)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int],
                 timeout_s: float | None = None) -> None:
        import xgrammar as xgr

        # the model's vocabulary may be padded past the tokenizer's: those ids are never allowed
        self.vocab_size = vocab_size
        # seconds a request may wait for its grammar before it fails (the compile itself cannot
        # be interrupted; its result is still cached for later requests)
        self.timeout_s = envs.PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT if timeout_s is None else timeout_s
        self.stop_token_ids = sorted(stop_token_ids)
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size, self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, params: GuidedDecodingParams) -> Future:
        key = params.cache_key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, params)
            self._cache[key] = fut
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, params: GuidedDecodingParams) -> Any:
        grammar = parse_grammar(params)
        return self._compiler.compile_grammar(grammar)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
