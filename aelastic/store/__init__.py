"""The key-value store: torch's TCPStore protocol served and spoken from an event loop."""
