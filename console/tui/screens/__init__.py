"""Modal screens: confirm, details, help, history, quit."""
