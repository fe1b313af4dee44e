"""Model definitions (Llama family: Llama, Qwen2, Qwen3, Mistral), tensor-parallel layers
and the safetensors loader. Imports nothing from Ray or Redis."""
