"""aloader: an asyncio-native streaming data loader with torch.utils.data's semantics.

Quick start::

    loader = aloader.DataLoader(dataset, batch_size=32, shuffle=True, generator=0)
    async for batch in loader:  # one epoch
        ...
"""

from ._batcher import Batcher, batch
from ._collate import collate, default_collate, default_collate_fn_map, default_convert
from ._dataset import (
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
from ._distributed import DistributedSampler
from ._exceptions import (
    AloaderError,
    BatcherClosedError,
    BatcherTimeoutError,
    BatchResultError,
    FetchError,
    LoaderClosedError,
    LoaderTimeoutError,
    QueueFullError,
    RecordError,
    SourceError,
    WorkerError,
)
from ._formats import SourceStats
from ._loader import DataLoader
from ._mix import mix
from ._parquet import ParquetRows
from ._sampler import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from ._sources import BinaryRecords, JsonLines, NpyRows, ShardedSource, TextLines
from ._streams import Stream, as_stream, interleave
from ._worker import get_worker_info

__version__ = "0.1.0.dev0"

__all__ = (
    # loading
    "DataLoader",
    "get_worker_info",
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
    "collate",
    "default_collate",
    "default_collate_fn_map",
    "default_convert",
    # streaming sources
    "BinaryRecords",
    "JsonLines",
    "NpyRows",
    "ParquetRows",
    "ShardedSource",
    "SourceStats",
    "Stream",
    "TextLines",
    "as_stream",
    "interleave",
    "mix",
    # inference batching
    "Batcher",
    "batch",
    # errors
    "AloaderError",
    "BatcherClosedError",
    "BatcherTimeoutError",
    "BatchResultError",
    "FetchError",
    "LoaderClosedError",
    "LoaderTimeoutError",
    "QueueFullError",
    "RecordError",
    "SourceError",
    "WorkerError",
)
