"""On-disk formats: safetensors files, Hugging Face folders, GGUF files, gemmalite's quantized checkpoints."""
