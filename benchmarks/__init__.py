"""Benchmarks (run as modules: `python -m benchmarks.verify_routes`)."""
