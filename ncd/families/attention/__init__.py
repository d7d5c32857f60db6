"""attention family."""
