"""What the panes show: collectors returning immutable snapshots (no Textual, no torch)."""
