"""polykan family."""
