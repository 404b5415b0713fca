"""Metrics: one processor with namespaced keys, pluggable sinks, and the device peak for MFU."""
