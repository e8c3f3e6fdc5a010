"""A loader's state across the ranks of a job as a ``torch.distributed.checkpoint``
``Stateful``: :class:`DistributedState`.

Invariant: what :meth:`DistributedState.state_dict` returns is the same on every rank (every
rank's state, gathered), so DCP, which keeps one copy of a key every rank writes, keeps all of
them, and a job of any size finds all of them under the same keys; loading merges them
(:func:`aloader.loader._ranks.merge_rank_states`) and each rank takes its part.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from ._dataloader import DataLoader
from ._ranks import merge_rank_states

__all__ = ("DistributedState",)


class DistributedState:
    """A loader's state across the ranks of a job, as a ``torch.distributed.checkpoint``
    ``Stateful``: saved with the model and optimizer by ``dcp.save``, loaded by ``dcp.load``
    on any world size.

    ::

        import torch.distributed.checkpoint as dcp

        state = {"model": model_state, "loader": aloader.DistributedState(loader)}
        dcp.save(state, checkpoint_id=path)  # every rank, at the same step
        ...
        dcp.load(state, checkpoint_id=path)  # every rank of the new job, any world size

    :meth:`state_dict` gathers every rank's ``loader.state_dict()`` (a collective over
    ``group``, as ``dcp.save`` is: call it on every rank) into one entry per rank, stored as
    JSON text: the same value on every rank, so DCP keeps it once, and every rank of a job of
    another size finds all of them (a value per rank under a key per rank would be readable
    only by a job of the same size; one key of different values would keep one rank's).
    :meth:`load_state_dict` merges them (:func:`merge_rank_states`) and loads this rank's
    part. Without an initialized process group it holds this process's state alone.

    Args:
        loader: the rank's loader.
        group: the process group whose ranks share the data (default: the default group).
    """

    def __init__(self, loader: DataLoader[Any], group: Any = None) -> None:
        self.loader = loader
        self.group = group

    def state_dict(self) -> dict[str, Any]:
        """``{"world_size": W, "ranks": [JSON text of rank 0's state, ...]}``."""
        own = json.dumps(self.loader.state_dict())
        dist = sys.modules.get("torch.distributed")
        ranks = [own]
        if dist is not None and dist.is_available() and dist.is_initialized():
            ranks = [""] * dist.get_world_size(self.group)
            dist.all_gather_object(ranks, own, group=self.group)
        return {"world_size": len(ranks), "ranks": ranks}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load this rank's part of the ranks' states.

        Raises:
            ValueError: not a :meth:`state_dict`, or see :func:`merge_rank_states`.
        """
        ranks = state_dict.get("ranks") if isinstance(state_dict, Mapping) else None
        if not (isinstance(ranks, list) and all(isinstance(r, str) for r in ranks)
                and state_dict.get("world_size") == len(ranks)):
            raise ValueError("cannot load this distributed state: it should be "
                             "DistributedState.state_dict()'s {'world_size': W, 'ranks': "
                             "[W JSON texts]}")
        try:
            states = [json.loads(text) for text in ranks]
        except ValueError as exc:
            raise ValueError(f"cannot load this distributed state: a rank's state is not "
                             f"JSON ({exc})") from None
        self.loader.load_state_dict(merge_rank_states(states))
