"""One module per pane of the main screen, over one table widget (console.tui.tables)."""
