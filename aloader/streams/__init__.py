"""Stream and its transforms, mixing, resume and source statistics.

Internal: the public names are exported by ``aloader``.
"""
