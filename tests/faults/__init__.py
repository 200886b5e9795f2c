"""Fault-injection tests: real faults on real filesystems (see conftest.py and faultkit.py)."""
