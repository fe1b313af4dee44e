"""Speculative decoding: drafts that propose several tokens per step, and the exact check
that keeps the target model's distribution (issue 20).

    speculator.py          Speculator: who drafts each step, pacing, the spec_decode_* counters
    ngram_proposer.py      NgramProposer: prompt lookup over a request's own tokens, no model
    draft_proposer.py      DraftProposer: a draft model's k autoregressive passes, drafts and q
    draft_runner.py        DraftRunner: the draft's forward pass (the target's model code, TP 1)
    draft_blocks.py        DraftBlockPool: the draft's own KV blocks, never hashed or announced
    verify.py              the target's distributions at each draft, through the sampler
    rejection_sampler.py   RejectionSampler: accept or reject drafts (random and greedy), then
                           one recovered or bonus token; DraftBatch / RejectionOutput
"""
