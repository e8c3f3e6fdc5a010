"""Datasets, samplers, collate and fetch: torch.utils.data's pieces, on numpy.

Internal: the public names are exported by ``aloader``.
"""
