"""Benchmarks, and the PyTorch references of every method that the tests compare against.

Each script runs from the repository root as a module, e.g. ``python -m benchmarks.step_throughput --help``.
"""
