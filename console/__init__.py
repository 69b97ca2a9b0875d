"""User interfaces: the `dsv4` CLI and the `dsv4-console` TUI. Never imports torch at import time."""
