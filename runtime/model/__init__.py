"""DeepSeek V4 itself: config, dims, tensor contract, tokenizer, and the forward pass (torch only in
`forward` and `programs`; importing this package imports nothing)."""
