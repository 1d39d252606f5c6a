"""Provides the TUI's widgets: the op list, the heat strip, the module tree and the detail pane."""
