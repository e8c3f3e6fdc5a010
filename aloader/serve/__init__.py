"""The batcher that groups concurrent requests into batches.

Internal: the public names are exported by ``aloader``.
"""
