"""On-disk state: checkpoint reader, kernel cache, sidecar files, page-cache probes.

Nothing in this package imports from `runtime` or `console`.
"""
