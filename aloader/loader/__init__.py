"""DataLoader and the epochs it runs.

Internal: the public names are exported by ``aloader``.
"""
