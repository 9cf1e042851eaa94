"""The lab: everything that measures the library (quality, benchmarks, reports, plots).

Nothing in the library imports it; it imports the library like any user would.
"""
