"""Provides the TUI's screens: the main view, help, the replay form, consumer and input pickers, and op ancestry."""
