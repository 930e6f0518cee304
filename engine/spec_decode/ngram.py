"""Prompt-lookup proposals: the tokens that followed the latest earlier occurrence of the sequence's suffix.

The longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min tokens) that occurred before in the
sequence (prompt and output) wins; among its occurrences the most recent one, whose continuation is the
likeliest to be copied next (an edited passage, a repeated structure).
"""
from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: np.ndarray, num_tokens: int, n_min: int, n_max: int) -> list[int]:
    """Up to num_tokens draft tokens for the sequence token_ids (int64), or [] when no n-gram recurs."""
    length = token_ids.shape[0]
    if num_tokens < 1 or length < n_min + 1:
        return []
    history = token_ids[:-1]            # an occurrence must end before the last token
    match = history == token_ids[-1]    # match[j]: the n-gram ending at j equals the suffix, for n = 1, 2, ...
    best_end = -1
    for n in range(1, min(n_max, length - 1) + 1):
        if n > 1:
            # the n-gram ending at j also needs token j - n + 1 to equal the suffix's token -n
            match[n - 2] = False
            match[n - 1:] &= history[:length - n] == token_ids[-n]
        ends = np.flatnonzero(match)
        if ends.size == 0:
            break
        if n >= n_min:
            best_end = int(ends[-1])
    if best_end < 0:
        return []
    return token_ids[best_end + 1:best_end + 1 + num_tokens].tolist()
