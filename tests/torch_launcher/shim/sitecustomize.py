"""Put on PYTHONPATH by tests/torch_launcher/conftest.py: interpreters started during those tests (the spawn
children of torch's tests) that import torch's launcher modules get aelastic behind them too."""

import os

if os.environ.get("TORCH_LAUNCHER_SHIM") == "1":
    import aelastic_torch_shim

    aelastic_torch_shim.install()
