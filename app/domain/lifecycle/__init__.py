"""An item's life, decided from plain values (pure): status moves, deadlines, retry
timing, what to do after a failure."""
