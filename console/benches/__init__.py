"""The console's own benchmarks (`dsv4 bench console`, `dsv4 bench eta`): they measure console code,
so they live beside it; `bench/` measures the runtime and never imports `console/`."""
