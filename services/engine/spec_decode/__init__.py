"""Speculative decoding: drafts that propose several tokens per step, and the exact check
that keeps the target model's distribution (issue 20).

    speculator.py          Speculator: who drafts each step, pacing, the spec_decode_* counters
    ngram_proposer.py      NgramProposer: prompt lookup over a request's own tokens, no model
    drafter.py             Drafter: the seam of the drafters with a model (the three below)
    draft_sampling.py      drafts drawn through the target's sampling transforms, with their q
    draft_proposer.py      DraftProposer: a draft model's k autoregressive passes, drafts and q
    draft_runner.py        DraftRunner: the draft's forward pass (the target's model code, TP 1)
    draft_blocks.py        DraftBlockPool: a drafter's own KV blocks, never hashed or announced
    draft_rows.py          lay_out: the paged attention inputs of a drafter's batch (draft model, EAGLE)
    medusa_heads.py        MedusaHeads: Medusa heads and their loader (FasterDecoding or vLLM names)
    medusa_proposer.py     MedusaProposer: k drafts at once from the target's newest hidden state
    eagle_model.py         EagleDrafter: the EAGLE-1 one-layer drafter and its loader
    eagle_runner.py        EagleRunner: its forward pass over its own paged KV cache
    eagle_proposer.py      EagleProposer: k passes on the target's hidden states, rolled back
    verify.py              the target's distributions at each draft, through the sampler
    rejection_sampler.py   RejectionSampler: accept or reject drafts (random and greedy), then
                           one recovered or bonus token; DraftBatch / RejectionOutput
"""
