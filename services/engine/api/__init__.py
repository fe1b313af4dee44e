"""What callers of the engine use: `LLM` (offline) and `AsyncLLM` (serving), sampling
parameters and outputs, and the processors between them and the core: prompts in
(tokenize, validate, the P/D handover), tokens out (detokenize, stop strings, logprobs)."""
