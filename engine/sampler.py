"""Batched sampling on the device: every row has its own parameters, all rows sample in one step.

Order (vLLM's): structured-output grammar bitmask -> logit_bias -> min_tokens masking -> repetition / frequency / presence penalties ->
greedy rows take the argmax; the others: temperature -> top_k -> top_p -> min_p -> sample.
Logprobs are always those of the raw model distribution (log_softmax of the unmodified logits).

Sampling is an exponential race: argmax(probs / E) with E ~ Exponential(1) i.i.d. picks token i with
probability probs[i]; it is computed in log form, argmax(logits - log E), so no softmax is needed.
Each seeded row draws its noise from its own generator, so its tokens do not depend on which other
rows share the batch or where it sits in it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import xgrammar

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.spec_decode.rejection import DraftTensors

_NEG_INF = float("-inf")
_INF = float("inf")
# +inf logits become this finite value: softmax stays defined and later scaling cannot overflow fp32.
_BIG = 1e30
_MASK64 = (1 << 64) - 1


@dataclass
class SampleRow:
    """One sequence that samples a token this step (built by the engine)."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]          # tokens generated so far (before this step's token)
    generator: torch.Generator | None    # per-sequence, on the sampler's device; None = unseeded


@dataclass
class PenaltyTensors:
    """Only for the rows that use penalties (`rows`); ids are padded with vocab_size (a dropped column)."""
    rows: torch.Tensor                   # [P] int64, row index in the batch
    prompt_ids: torch.Tensor             # [P, Lp] int64
    output_ids: torch.Tensor             # [P, Lo] int64
    repetition: torch.Tensor             # [P] fp32
    frequency: torch.Tensor              # [P] fp32
    presence: torch.Tensor               # [P] fp32


@dataclass
class SamplingTensors:
    """Device tensors and host-side flags for one step; built by Sampler.prepare()."""
    num_rows: int
    all_greedy: bool
    any_greedy: bool
    temperature: torch.Tensor | None     # [B] fp32, greedy rows hold 1.0 (their samples are discarded)
    greedy_mask: torch.Tensor | None     # [B] bool (only for mixed batches)
    top_k: torch.Tensor | None           # [B] int64, vocab_size where off; None when no row uses it
    top_p: torch.Tensor | None           # [B] fp32, 2.0 where off (cannot be reached by a cumsum)
    min_p: torch.Tensor | None           # [B] fp32
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None   # (rows, token ids, values)
    banned: tuple[torch.Tensor, torch.Tensor] | None               # min_tokens: (rows, token ids)
    penalties: PenaltyTensors | None
    seeded: list[tuple[int, torch.Generator]]                      # (row, its generator)
    max_logprobs: int | None             # None: nobody asked for logprobs
    grammar: tuple[torch.Tensor | None, torch.Tensor] | None = None  # (rows or None: all, [R, ceil(V/32)] int32)
    drafts: DraftTensors | None = None   # speculative decoding: what the rows verify (engine/spec_decode)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor              # [num_rows] int64 on device
    logprobs: torch.Tensor | None        # [num_rows] fp32: raw log_softmax at the chosen token
    ranks: torch.Tensor | None           # [num_rows] int64: 1 + number of tokens with strictly higher logprob
    top_ids: torch.Tensor | None         # [num_rows, K], K = max logprobs asked in the batch (None if K == 0)
    top_logprobs: torch.Tensor | None


class _HostPack:
    """Collects named host values of one dtype and moves them to the device in a single copy."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.parts: dict[str, torch.Tensor] = {}

    def add(self, name: str, values: list | torch.Tensor) -> None:
        self.parts[name] = torch.as_tensor(values, dtype=self.dtype).reshape(-1)

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        if not self.parts:
            return {}
        flat = torch.cat(list(self.parts.values()))
        if device.type == "cuda":
            flat = flat.pin_memory()
        pieces = flat.to(device, non_blocking=True).split([p.numel() for p in self.parts.values()])
        return dict(zip(self.parts, pieces))


def _pad(rows: list[list[int]], pad: int) -> torch.Tensor:
    """Rows of token ids as one right-padded [len(rows), max_len] tensor (a C-level copy per row)."""
    out = torch.full((len(rows), max(1, max(len(r) for r in rows))), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def make_generator(self, seed: int, index: int) -> torch.Generator:
        """Generator for sample `index` (0..n-1) of a request seeded with `seed`: distinct streams per
        index, and the same stream for the same (seed, index) on every run."""
        return torch.Generator(device=self.device).manual_seed(_mix64(seed, index))

    # ------------------------------------------------------------------------------------ host side
    def prepare(self, rows: list[SampleRow]) -> SamplingTensors:
        """Build this step's device tensors with one host->device copy per dtype (float32, int64).
        Tensors a step does not need (no row uses the feature) are not built at all."""
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        all_greedy, any_greedy = all(greedy), any(greedy)
        floats, ints = _HostPack(torch.float32), _HostPack(torch.int64)
        if not all_greedy:
            sampled = [p for g, p in zip(greedy, params) if not g]
            floats.add("temperature", [1.0 if g else p.temperature for g, p in zip(greedy, params)])
            if any_greedy:
                ints.add("greedy", [int(g) for g in greedy])
            if any(p.top_k > 0 for p in sampled):
                v = self.vocab_size
                ints.add("top_k", [p.top_k if 0 < p.top_k < v else v for p in params])
            if any(p.top_p < 1.0 for p in sampled):
                floats.add("top_p", [p.top_p if p.top_p < 1.0 else 2.0 for p in params])
            if any(p.min_p > 0.0 for p in sampled):
                floats.add("min_p", [p.min_p for p in params])
        self._add_bias(rows, floats, ints)
        self._add_banned(rows, ints)
        self._add_penalties(rows, floats, ints)
        dev = {**floats.to(self.device), **ints.to(self.device)}
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingTensors(
            num_rows=len(rows), all_greedy=all_greedy, any_greedy=any_greedy,
            temperature=dev.get("temperature"),
            greedy_mask=dev["greedy"].bool() if "greedy" in dev else None,
            top_k=dev.get("top_k"), top_p=dev.get("top_p"), min_p=dev.get("min_p"),
            bias=(dev["bias_rows"], dev["bias_ids"], dev["bias_vals"]) if "bias_rows" in dev else None,
            banned=(dev["ban_rows"], dev["ban_ids"]) if "ban_rows" in dev else None,
            penalties=_penalty_tensors(dev),
            seeded=[(i, r.generator) for i, r in enumerate(rows) if r.generator is not None and not greedy[i]],
            max_logprobs=max(asked) if asked else None,
        )

    def _add_bias(self, rows: list[SampleRow], floats: _HostPack, ints: _HostPack) -> None:
        entries = [(i, tok, val) for i, r in enumerate(rows) for tok, val in (r.params.logit_bias or {}).items()]
        if not entries:
            return
        self._check_ids("logit_bias", [tok for _, tok, _ in entries])
        ints.add("bias_rows", [i for i, _, _ in entries])
        ints.add("bias_ids", [tok for _, tok, _ in entries])
        floats.add("bias_vals", [val for _, _, val in entries])

    def _add_banned(self, rows: list[SampleRow], ints: _HostPack) -> None:
        """min_tokens: the tokens that would end the sequence are masked until it is long enough.
        With ignore_eos, eos does not end it, so only stop_token_ids are masked."""
        pairs = []
        for i, r in enumerate(rows):
            p = r.params
            if len(r.output_token_ids) < p.min_tokens:
                enders = set(p.stop_token_ids or []) | (set() if p.ignore_eos else set(p.eos_token_ids))
                pairs.extend((i, tok) for tok in sorted(enders))
        if not pairs:
            return
        self._check_ids("stop_token_ids", [tok for _, tok in pairs])
        ints.add("ban_rows", [i for i, _ in pairs])
        ints.add("ban_ids", [tok for _, tok in pairs])

    def _add_penalties(self, rows: list[SampleRow], floats: _HostPack, ints: _HostPack) -> None:
        pen = [i for i, r in enumerate(rows) if r.params.uses_penalties]
        if not pen:
            return
        ps = [rows[i].params for i in pen]
        ints.add("pen_rows", pen)
        ints.add("pen_prompt", _pad([rows[i].prompt_token_ids for i in pen], self.vocab_size))
        ints.add("pen_output", _pad([rows[i].output_token_ids for i in pen], self.vocab_size))
        floats.add("pen_rep", [p.repetition_penalty for p in ps])
        floats.add("pen_freq", [p.frequency_penalty for p in ps])
        floats.add("pen_pres", [p.presence_penalty for p in ps])

    def _check_ids(self, what: str, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} names token id {bad[0]}, outside the vocabulary (size {self.vocab_size}).")

    # ---------------------------------------------------------------------------------- device side
    def sample(self, logits: torch.Tensor, st: SamplingTensors,
               pick: Callable[[torch.Tensor, SamplingTensors], torch.Tensor] | None = None) -> SamplerOutput:
        """logits: [num_rows, vocab] (fp32). No host<->device synchronisation happens here.
        pick: chooses the tokens from the processed logits instead of sampling them (speculative decoding's
        verification, engine/spec_decode/rejection.py)."""
        if tuple(logits.shape) != (st.num_rows, self.vocab_size):
            raise RuntimeError(f"logits of shape {tuple(logits.shape)} for {st.num_rows} rows and a "
                               f"vocabulary of {self.vocab_size}")
        plain = (st.bias is None and st.banned is None and st.penalties is None and st.max_logprobs is None
                 and st.grammar is None and pick is None)
        if st.all_greedy and plain:
            # The common fast path: one scrub (NaN would win an argmax) and one argmax.
            return SamplerOutput(_scrub(logits, posinf=_INF).argmax(-1), None, None, None, None)
        x = _scrub(logits.float(), posinf=_BIG)          # our own copy: edited in place below
        raw_logprobs = x.log_softmax(-1).nan_to_num_(nan=_NEG_INF) if st.max_logprobs is not None else None
        if st.grammar is not None:
            _apply_grammar_bitmask(x, *st.grammar)
        if st.bias is not None:
            rows, ids, vals = st.bias
            x.index_put_((rows, ids), vals, accumulate=True)
        if st.banned is not None:
            x.index_put_(st.banned, x.new_tensor(_NEG_INF))
        if st.penalties is not None:
            _apply_penalties(x, st.penalties, self.vocab_size)
        if pick is not None:
            token_ids = pick(x, st)
        elif st.all_greedy:
            token_ids = x.argmax(-1)
        else:
            greedy_ids = x.argmax(-1) if st.any_greedy else None   # before x is tempered in place
            token_ids = self._sample(x, st)
            if greedy_ids is not None:
                token_ids = torch.where(st.greedy_mask, greedy_ids, token_ids)
        return _with_logprobs(token_ids, raw_logprobs, st.max_logprobs)

    def _sample(self, x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        temper(x, st)
        return gumbel_argmax(x, self.uniform(x, st))

    def uniform(self, like: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """U(0, 1) noise shaped like `like` (rows first); seeded rows draw theirs from their own generator."""
        uniform = torch.empty_like(like, dtype=torch.float32).uniform_(generator=self.generator)
        for row, gen in st.seeded:
            uniform[row].uniform_(generator=gen)
        return uniform


def temper(x: torch.Tensor, st: SamplingTensors) -> None:
    """In place: temperature, then top_k / top_p and min_p masking (the sampled rows' distribution)."""
    x.div_(st.temperature.unsqueeze(1))
    if st.top_k is not None or st.top_p is not None:
        _apply_top_k_top_p(x, st.top_k, st.top_p)
    if st.min_p is not None:
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); log(0) = -inf masks nothing.
        floor = x.amax(-1, keepdim=True) + st.min_p.log().unsqueeze(1)
        x.masked_fill_(x < floor, _NEG_INF)


def gumbel_argmax(x: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel-max, the log form of the exponential race argmax(p / E): argmax(x - log E), E = -log U.
    U = 0 gives E = inf: that token cannot win (an event of probability 2^-24 per token)."""
    return (x - uniform.log_().neg_().log_()).argmax(-1)


def _mix64(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): nearby seeds and indices give unrelated generator states."""
    x = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def _scrub(logits: torch.Tensor, posinf: float) -> torch.Tensor:
    """NaN -> -inf (never chosen); +inf -> posinf. A row with nothing finite picks token 0."""
    return torch.nan_to_num(logits, nan=_NEG_INF, posinf=posinf, neginf=_NEG_INF)


def _apply_grammar_bitmask(x: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> None:
    """Tokens whose bit is 0 in their row's bitmask (bit t % 32 of word t // 32) become -inf.
    rows None: every row is constrained, in order."""
    sub = x if rows is None else x.index_select(0, rows)
    if x.device.type == "cpu":
        xgrammar.apply_token_bitmask_inplace(sub, bitmask)     # its C++ kernel: ~10x the torch unpacking below
    else:
        bits = torch.arange(32, device=x.device, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :x.shape[1]]
        sub.masked_fill_(~allowed, _NEG_INF)
    if rows is not None:
        x.index_copy_(0, rows, sub)


def _apply_penalties(x: torch.Tensor, pt: PenaltyTensors, vocab_size: int) -> None:
    """repetition over prompt + output tokens; frequency and presence over output tokens."""
    num = pt.rows.numel()
    counts = torch.zeros(num, vocab_size + 1, device=x.device)
    counts.scatter_add_(1, pt.output_ids, torch.ones_like(pt.output_ids, dtype=counts.dtype))
    counts = counts[:, :vocab_size]                       # drop the padding column
    in_prompt = torch.zeros(num, vocab_size + 1, dtype=torch.bool, device=x.device)
    in_prompt.scatter_(1, pt.prompt_ids, True)
    seen = in_prompt[:, :vocab_size] | (counts > 0)
    sub = x.index_select(0, pt.rows)
    rep = pt.repetition.unsqueeze(1)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= pt.frequency.unsqueeze(1) * counts + pt.presence.unsqueeze(1) * (counts > 0)
    x.index_copy_(0, pt.rows, sub)


def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """Mask (to -inf, in place) what top_k and then top_p remove; one sort serves both."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_x.gather(1, (top_k - 1).clamp(0, x.shape[1] - 1).unsqueeze(1))
        drop = sorted_x < kth                             # ties with the k-th token are kept
        sorted_x = sorted_x.masked_fill(drop, _NEG_INF)
    else:
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)
    if top_p is not None:
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs            # keep tokens until top_p is reached
        drop |= mass_before >= top_p.unsqueeze(1)         # the best token always has 0 before it
    x.masked_fill_(torch.empty_like(drop).scatter_(1, order, drop), _NEG_INF)


def _with_logprobs(token_ids: torch.Tensor, logprobs: torch.Tensor | None, k: int | None) -> SamplerOutput:
    if logprobs is None or k is None:
        return SamplerOutput(token_ids, None, None, None, None)
    chosen = logprobs.gather(1, token_ids.clamp_min(0).unsqueeze(1))   # -1: a rejected draft's row (unused)
    ranks = (logprobs > chosen).sum(-1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    return SamplerOutput(token_ids, chosen.squeeze(1), ranks, top_ids, top_lp)


def score_tokens(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> SamplerOutput:
    """prompt_logprobs: each row's raw log-probability of the given token, its rank and the k best."""
    logprobs = _scrub(logits.float(), posinf=_BIG).log_softmax(-1).nan_to_num_(nan=_NEG_INF)
    return _with_logprobs(token_ids.long(), logprobs, k)


def _penalty_tensors(dev: dict[str, torch.Tensor]) -> PenaltyTensors | None:
    if "pen_rows" not in dev:
        return None
    num = dev["pen_rows"].numel()
    return PenaltyTensors(rows=dev["pen_rows"], prompt_ids=dev["pen_prompt"].view(num, -1),
                          output_ids=dev["pen_output"].view(num, -1), repetition=dev["pen_rep"],
                          frequency=dev["pen_freq"], presence=dev["pen_pres"])
