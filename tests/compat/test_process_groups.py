"""Real process groups: 2 to 4 processes with torchrun's environment and a ``gloo`` group on
127.0.0.1 (tests/ranktools.py starts them, each run bounded in time), loaders with
``num_workers`` 0 and 2 in each rank.

Pinned: every sample once across the ranks per epoch (map-style with DistributedSampler, and a
sharded, shuffled JSON Lines stream); equal batch counts per rank where promised (map-style,
``records_per_rank``), checked by a collective at every step; a 4-rank job killed mid-epoch
right after a ``torch.distributed.checkpoint`` save (``aloader.DistributedState``) resumes on
2 and on 3 ranks with every remaining sample exactly once, then runs whole epochs there; a
rank that fails is an error on every rank, not a hang.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
pytest.importorskip("torch.distributed.checkpoint")

from ranktools import (  # noqa: E402
    N_MAP,
    RankRun,
    all_records,
    explain,
    launch,
    write_shards,
)

# Workers on a machine with fewer cores; the hang guard is the launcher's (each run).
pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create"),
              pytest.mark.timeout(400)]


def ids(samples: list[object]) -> Counter[str]:
    return Counter(str(sample) for sample in samples)


def once(samples: list[object], expected: list[object]) -> bool:
    counts = ids(samples)
    return counts == ids(expected) and set(counts.values()) == {1}


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[RankRun]]:
    """Whole epochs on 4 ranks, then the job killed right after a checkpoint mid-epoch."""
    folder = tmp_path_factory.mktemp("ranks")
    write_shards(folder)
    runs = launch(4, "epochs", folder)
    assert all(run.result is not None for run in runs), explain(runs)
    return folder, runs


def test_every_sample_once_per_epoch_across_four_ranks(killed_job: tuple[Path, list[RankRun]]
                                                      ) -> None:
    folder, runs = killed_job
    result = runs[0].result
    assert all(run.result == result for run in runs[1:])  # every rank saw the same steps
    for workers in (0, 2):
        for epoch in range(2):
            seen = result[f"map-{workers}-{epoch}"]
            assert once(seen["samples"], list(range(N_MAP))), (workers, epoch)
        first, second = result[f"stream-{workers}"]
        assert once(first["samples"], all_records(folder)), workers
        assert once(second["samples"], all_records(folder)), workers
        assert first["samples"] != second["samples"]  # shuffled anew each epoch
    assert result["map-0-0"]["samples"] != result["map-0-1"]["samples"]
    assert result["map-0-0"] == result["map-2-0"]  # workers change nothing


def test_equal_batch_counts_where_promised(killed_job: tuple[Path, list[RankRun]]) -> None:
    result = killed_job[1][0].result
    for workers in (0, 2):
        for name in (f"map-{workers}-0", f"map-{workers}-1", f"quota-{workers}"):
            flags = result[name]["flags"]
            assert flags and all(all(step) for step in flags), (name, flags)
        assert len(result[f"quota-{workers}"]["samples"]) == 4 * 17
        # Without a promise (even_ranks=False, unequal shards) the ranks end apart, and the
        # collective at every step still ends the epoch on every rank.
        assert any(not all(step) for step in result[f"stream-{workers}"][0]["flags"])


@pytest.mark.parametrize(("world", "workers"), [(2, 2), (3, 0)])
def test_a_killed_four_rank_job_resumes_on(world: int, workers: int,
                                           killed_job: tuple[Path, list[RankRun]]) -> None:
    folder, killed = killed_job
    assert all(run.returncode != 0 for run in killed)  # killed, after the checkpoint
    before = killed[0].result["before"]
    runs = launch(world, "resume", folder, workers=workers)
    assert all(run.returncode == 0 for run in runs), explain(runs)
    result = runs[0].result
    assert all(run.result == result for run in runs[1:])
    mapped = [x for x in before if isinstance(x, int)]
    streamed = [x for x in before if isinstance(x, list)]
    assert len(mapped) == 4 * 2 * 3  # 4 ranks, 2 steps, batches of 3
    assert once(mapped + result["map-rest"]["samples"], list(range(N_MAP)))
    assert all(all(step) for step in result["map-rest"]["flags"])  # equal shares of the rest
    assert once(streamed + result["stream-rest"]["samples"], all_records(folder))
    # Then whole epochs on the new world size.
    assert once(result["map-next"]["samples"], list(range(N_MAP)))
    assert once(result["stream-next"]["samples"], all_records(folder))


def test_a_failing_rank_is_an_error_on_every_rank(tmp_path: Path) -> None:
    runs = launch(2, "failing", tmp_path)
    assert all(run.returncode not in (0, None) for run in runs), explain(runs)
    assert runs[1].result == {"started": True}
    assert "WorkerError" in runs[1].log, explain(runs)  # its own loader's error
    assert "Traceback" in runs[0].log, explain(runs)  # the peer's collective failed
