"""Sharded sources, sharding and record formats (text, JSON Lines, npy, tar, Parquet).

Internal: the public names are exported by ``aloader``.
"""
