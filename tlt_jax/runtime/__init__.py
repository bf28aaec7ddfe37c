"""Process-level tuning of the host (malloc), called by entry points, never by library code."""
