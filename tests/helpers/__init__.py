"""What several test modules share: an in-memory console (``console``), process and port checks (``procs``), the
store tests' checks and torch's own TCPStore client in a process of its own (``store``, ``torch_store_peer``), a
relay that goes silent like a lost network (``relay``) and a reader of etcd's keys (``etcd``). Fixtures live in
``tests/conftest.py``; worker scripts that tests run as files (``cli_probe.py``, ``rdzv_node.py``) stay beside
the tests."""
