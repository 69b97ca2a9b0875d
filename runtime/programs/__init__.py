"""Programs: specs and their keys (torch-free), the model's catalogue, compiling and loading through
the kernel cache, the compile pool, tiers, and the programs phase of a launch."""
