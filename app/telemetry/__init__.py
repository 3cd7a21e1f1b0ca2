"""OpenTelemetry traces and metrics in the GenAI conventions (off unless OTEL_* says)."""
