"""Byte transports: local files, HTTP, object stores, the shard cache and content codecs.

Internal: the public names are exported by ``aloader``.
"""
