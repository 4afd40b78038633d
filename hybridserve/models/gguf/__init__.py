"""GGUF checkpoints (llama.cpp's single-file format): config and tokenizer from the file's metadata, tensors
mapped by llama.cpp's names back to the transformers layout the models load (``docs/gguf.md``)."""
