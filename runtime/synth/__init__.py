"""Synthetic DeepSeek V4 checkpoints (real names, dtypes and formats at shrunk dims) and their tokenizer."""
