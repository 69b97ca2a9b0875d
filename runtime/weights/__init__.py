"""Packed weights: the packed layout as data (`layout`, torch-free), packing, prepack into a
sidecar, the views programs read, and the loaders that map or repack."""
