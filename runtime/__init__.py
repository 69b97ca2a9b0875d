"""DeepSeek V4 runtime. This package's __init__, `events` and `config` import no torch."""
