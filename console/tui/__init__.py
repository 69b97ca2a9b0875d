"""`dsv4-console`: the Textual app (app, panes, screens, the data collectors behind them)."""
