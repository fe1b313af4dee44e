"""Speculative decoding: drafts that propose several tokens per step, and the exact check
that keeps the target model's distribution (issue 20). Standalone for now: the scheduler and
model runner do not call these yet.

    ngram_proposer.py      NgramProposer: prompt lookup over a request's own tokens, no model
    rejection_sampler.py   RejectionSampler: accept or reject drafts (random and greedy), then
                           one recovered or bonus token; DraftBatch / RejectionOutput
"""
