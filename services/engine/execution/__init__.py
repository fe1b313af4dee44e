"""What runs each step: executors (in-process or one Ray actor per tensor-parallel rank),
each rank's model and KV cache (`ModelRank`), the model runner and the sampler."""
