"""A quantized engine scored against the float one on the float one's greedy continuations."""

from __future__ import annotations

import random

from baton.services.engine import LLM, SamplingParams


def teacher_forced(reference: LLM, other: LLM, num_prompts: int = 6, num_tokens: int = 24):
    """`other` scored on `reference`'s greedy continuations: the share of positions where its
    argmax is the reference's token, and |logprob difference| of that token at each."""
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 500) for _ in range(16)] for _ in range(num_prompts)]
    outputs = reference.generate(prompts, SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True))
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, outputs, strict=True)]
    score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    ref, got = reference.generate(seqs, score), other.generate(seqs, score)
    agree, errors = [], []
    for seq, r, g in zip(seqs, ref, got, strict=True):
        for pos in range(len(prompts[0]), len(seq)):
            token = seq[pos]
            agree.append(g.prompt_logprobs[pos][token].rank == 1)
            errors.append(abs(g.prompt_logprobs[pos][token].logprob - r.prompt_logprobs[pos][token].logprob))
    return sum(agree) / len(agree), errors, outputs
