"""aloader: an asyncio-native streaming data loader with torch.utils.data's semantics.

This module owns the public namespace and nothing else: every public name is defined in a
private module (``aloader.loader._dataloader``, ``aloader.data._dataset``,
``aloader.sources._sources``...) and
re-exported here, listed in ``__all__``, and says it lives here (``__module__ = "aloader"``,
see :mod:`aloader._public`), so reprs, ``help()``, docs and pickles name ``aloader.DataLoader``.

Quick start::

    loader = aloader.DataLoader(dataset, batch_size=32, shuffle=True, generator=0)
    async for batch in loader:  # one epoch
        ...
"""

from . import _public
from ._exceptions import (
    AccessDeniedError,
    AloaderError,
    BatchCostError,
    BatcherClosedError,
    BatcherTimeoutError,
    BatchResultError,
    BucketNotFoundError,
    EndpointUnreachableError,
    FailureBudgetExceeded,
    FetchError,
    LoaderClosedError,
    LoaderTimeoutError,
    ObjectNotFoundError,
    QueueFullError,
    RecordError,
    SampleRngError,
    SourceError,
    Throttled,
    WorkerError,
)
from ._stats import LoaderStats, SourceStats, StageStats
from ._trace import Trace
from ._workerinfo import WorkerInfo, get_worker_info
from .data._batchsampler import BatchSampler
from .data._collate import (
    ColumnBatch,
    collate,
    default_collate,
    default_collate_fn_map,
    default_convert,
)
from .data._dataset import (
    ArrayDataset,
    ChainDataset,
    ConcatDataset,
    Dataset,
    IterableDataset,
    StackDataset,
    Subset,
    TensorDataset,
    random_split,
)
from .data._distributed import DistributedSampler
from .data._sampler import (
    RandomSampler,
    Sampler,
    SequentialSampler,
    Stateful,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from .io._http import HttpOptions
from .loader._dataloader import AsyncDataLoaderIter, DataLoader, DataLoaderIter
from .loader._dcp import DistributedState
from .loader._ranks import merge_rank_states
from .pipeline._sample_rng import sample_rng
from .serve._batcher import Batcher
from .serve._decorator import BatchMethod, batch
from .serve._metrics import BatcherMetrics, LatencySummary
from .serve._results import BatchStream
from .sources._parquet import ParquetRows
from .sources._ray import from_ray
from .sources._sharded import ShardedSource, SourceOptions
from .sources._sources import BinaryRecords, JsonLines, NpyRows, TextLines
from .sources._tar import TarShards
from .streams._iterated import as_stream
from .streams._mix import interleave, mix
from .streams._stream import Stream

__version__ = "0.1.0.dev0"

__all__ = (
    # loading
    "AsyncDataLoaderIter",
    "DataLoader",
    "DataLoaderIter",
    "DistributedState",
    "LoaderStats",
    "StageStats",
    "Trace",
    "WorkerInfo",
    "get_worker_info",
    "merge_rank_states",
    "sample_rng",
    "Stateful",
    # datasets
    "ArrayDataset",
    "ChainDataset",
    "ConcatDataset",
    "Dataset",
    "IterableDataset",
    "StackDataset",
    "Subset",
    "TensorDataset",
    "random_split",
    # samplers
    "BatchSampler",
    "DistributedSampler",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "SubsetRandomSampler",
    "WeightedRandomSampler",
    # collate
    "ColumnBatch",
    "collate",
    "default_collate",
    "default_collate_fn_map",
    "default_convert",
    # streaming sources
    "BinaryRecords",
    "HttpOptions",
    "JsonLines",
    "NpyRows",
    "ParquetRows",
    "ShardedSource",
    "SourceOptions",
    "SourceStats",
    "Stream",
    "TarShards",
    "TextLines",
    "as_stream",
    "from_ray",
    "interleave",
    "mix",
    # inference batching
    "Batcher",
    "BatcherMetrics",
    "BatchMethod",
    "BatchStream",
    "LatencySummary",
    "batch",
    # errors
    "AccessDeniedError",
    "AloaderError",
    "BatchCostError",
    "BatcherClosedError",
    "BatcherTimeoutError",
    "BatchResultError",
    "BucketNotFoundError",
    "EndpointUnreachableError",
    "FailureBudgetExceeded",
    "FetchError",
    "LoaderClosedError",
    "LoaderTimeoutError",
    "ObjectNotFoundError",
    "QueueFullError",
    "RecordError",
    "SampleRngError",
    "SourceError",
    "Throttled",
    "WorkerError",
)

_public.present_as(__name__, [globals()[name] for name in __all__])
