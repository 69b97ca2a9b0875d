"""A launch: its spec, the plan of it, the KV budget and the host's devices (all torch-free), and the
registration that acts on the plan; ranks and the launch history."""
