"""The engine's compiled-grammar cache: the same spec compiles once, in a thread pool off the engine loop.

xgrammar compiles in C++ without holding the GIL, so a compile never stalls the engine thread. A compile
that runs past `timeout_s` fails its requests (a user error: the spec is too hard), and the spec is
remembered as failed, so that sending it again is refused at once instead of taking another worker.
The C++ compile itself cannot be interrupted: the worker stays busy until it ends, which the size limits
of StructuredOutputs keep short.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import xgrammar as xg

from engine.structured.grammar import build_grammar, compiler_message
from engine.structured.spec import StructuredOutputs

MAX_CACHED_GRAMMARS = 512


@dataclass
class PendingGrammar:
    """One request's grammar: ready when the future is done (result or ValueError) or the deadline passed."""
    future: Future
    deadline: float
    key: tuple = ()

    def result(self, now: float) -> xg.CompiledGrammar | ValueError | None:
        """None while compiling; a ValueError for the request when it failed or took too long."""
        if self.future.done():
            exc = self.future.exception()
            return exc if exc is not None else self.future.result()
        if now >= self.deadline:
            return ValueError("compiling the structured output constraint took too long; simplify the "
                              "schema, regex or grammar.")
        return None


@dataclass
class GrammarCache:
    tokenizer_info: xg.TokenizerInfo
    timeout_s: float = 10.0
    num_workers: int = 2
    # Compile times, drained into EngineStats: appended by the compile threads, taken by the engine thread one
    # by one (deque's append and popleft are atomic; swapping a list could drop an append in flight).
    compile_seconds: deque[float] = field(default_factory=deque)
    _cache: OrderedDict = field(default_factory=OrderedDict)
    _timed_out: set = field(default_factory=set)      # keys whose compile outlived a request's deadline
    _pool: ThreadPoolExecutor | None = None
    _compiler: xg.GrammarCompiler | None = None

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: list[int], **kwargs) -> GrammarCache:
        info = xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        return cls(info, **kwargs)

    def submit(self, spec: StructuredOutputs) -> PendingGrammar:
        key = spec.key()
        future = self._cache.get(key)
        if future is None:
            if self._pool is None:   # started on first use: servers without constrained traffic pay nothing
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="pagedserve-grammar")
                self._compiler = xg.GrammarCompiler(self.tokenizer_info, max_threads=1)
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        now = time.monotonic()
        deadline = now if key in self._timed_out and not future.done() else now + self.timeout_s
        return PendingGrammar(future, deadline, key)

    def mark_timed_out(self, pending: PendingGrammar) -> None:
        self._timed_out.add(pending.key)

    def _compile(self, spec: StructuredOutputs) -> xg.CompiledGrammar:
        t0 = time.perf_counter()
        grammar = build_grammar(spec)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise ValueError(f"the constraint cannot be compiled: {compiler_message(exc)}") from None
        self.compile_seconds.append(time.perf_counter() - t0)
        return compiled

    def drain_compile_seconds(self) -> list[float]:
        taken = []
        while self.compile_seconds:
            taken.append(self.compile_seconds.popleft())
        return taken

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
