"""Worker processes: the pool, the worker's loop, spawning and shared memory.

Internal: the public names are exported by ``aloader``.
"""
