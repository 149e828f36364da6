"""The multi-host fault-injection suite: hosts are network namespaces on a private bridge (see conftest.py)."""
