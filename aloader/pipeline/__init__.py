"""One epoch's machinery: the results buffer, scheduling, fetch threads, failures.

Internal: the public names are exported by ``aloader``.
"""
