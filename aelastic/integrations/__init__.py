"""aelastic inside the frameworks people train with: each module is one framework's side of aelastic's features,
for the worker's interpreter, and imports its framework on first use (``pip install 'aelastic[<framework>]'``).
The agent never imports them.
"""
