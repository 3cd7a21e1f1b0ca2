"""What operators read: Prometheus metrics and the status snapshot."""
