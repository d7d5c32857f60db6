"""rational family."""
