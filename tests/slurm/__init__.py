"""Tests on a real Slurm cluster built in network namespaces on this machine (see cluster.py)."""
