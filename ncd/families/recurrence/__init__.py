"""recurrence family."""
