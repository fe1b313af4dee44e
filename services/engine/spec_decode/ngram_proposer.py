"""Prompt-lookup (n-gram) drafting: guess the next tokens by finding the sequence's own tail
earlier in the sequence, and proposing what followed it there. No model runs.

For a request's token ids t[0 .. L) (prompt and output so far):

  1. the longest n in [prompt_lookup_min, prompt_lookup_max] for which the suffix
     t[L - n .. L) also occurs earlier, as t[s .. s + n) with s + n < L (so at least one
     token follows it; occurrences may overlap the suffix);
  2. of those occurrences, the earliest (smallest s);
  3. the drafts: t[s + n .. s + n + k), fewer where the sequence ends first. No match: none.

      t:   7 1 2 3 9 4 1 2 3          suffix n = 3: [1 2 3], found at s = 1
               ^^^^^ -> 9 4 1 2       drafts for k = 4 (the tokens after the match)

Why the earliest occurrence: it is what vLLM's `ngram` method proposes (its KMP search
keeps the leftmost of the longest matches), so the two engines draft the same tokens for
the same sequence and their acceptance can be compared; and it leaves the most tokens
after the match. In a loop of period P the latest occurrence is P tokens before the end
and yields only P drafts, where the earliest yields k.

The search compares the suffix against every earlier position at once, one numpy pass per
n-gram length (prompt_lookup_max passes over L tokens), never a Python loop over positions.
The caller caps k further where the request has less room (max_tokens, max_model_len).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Drafts up to `num_speculative_tokens` tokens per request by prompt lookup."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int) -> None:
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({prompt_lookup_max}) must be >= prompt_lookup_min ({prompt_lookup_min})"
            )
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        """The drafts for one request's tokens (prompt + output); [] when nothing matches."""
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be one sequence, got shape {tokens.shape}")
        match_end = find_match_end(tokens, self.prompt_lookup_min, self.prompt_lookup_max)
        if match_end is None:
            return []
        return tokens[match_end : match_end + self.num_speculative_tokens].tolist()

    def propose_batch(self, token_ids: Sequence[Sequence[int] | np.ndarray]) -> list[list[int]]:
        """`propose` for each request of a batch, in order."""
        return [self.propose(tokens) for tokens in token_ids]


def find_match_end(tokens: np.ndarray, min_n: int, max_n: int) -> int | None:
    """Where the tokens after the match start: s + n in the module header, or None.

    match_len[i] is how many tokens before position i + 1 agree with the sequence's last
    ones (capped at max_n), i.e. the length of the suffix occurrence ending at i + 1.
    Pass j compares t[i - j] with t[L - 1 - j] for every candidate i in [0, L - 2] at once.
    """
    num_tokens = tokens.shape[0]
    max_n = min(max_n, num_tokens - 1)  # an earlier occurrence is at most L - 1 long
    if max_n < min_n:
        return None
    still_equal = np.ones(num_tokens - 1, dtype=bool)
    match_len = np.zeros(num_tokens - 1, dtype=np.int32)
    for j in range(max_n):
        if j:
            still_equal[j - 1] = False  # i = j - 1 has no t[i - j]: its occurrence starts at 0
        still_equal[j:] &= tokens[: num_tokens - 1 - j] == tokens[num_tokens - 1 - j]
        match_len += still_equal
        if not still_equal.any():
            break
    longest = int(match_len.max())
    if longest < min_n:
        return None
    return int(np.argmax(match_len == longest)) + 1  # argmax: the first, i.e. earliest, of the longest
