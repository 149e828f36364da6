"""The elastic agent: one node's worker group, its processes, logs and error reports."""
