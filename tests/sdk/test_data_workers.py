"""DataLoader with worker processes (num_workers > 0, deepx_sdk/utils/_workers.py): the same batches as without them,
made ahead of the loop as heap tensors that are deleted once used, and a worker's failure or death named."""

from __future__ import annotations

import gc
import os
import signal
import time

import numpy as np
import pytest
import torch.utils.data as tdata

import deepx_sdk as dx
from deepx_core.client import NativeClient
from deepx_core.errors import DeepxError
from deepx_sdk.session import session
from deepx_sdk.utils.data import DataLoader, Dataset, Generator


class Samples(Dataset):
    """Each sample: an array, an int label, a float weight, a string tag, in a dict."""

    def __init__(self, n: int = 37) -> None:
        rng = np.random.default_rng(3)
        self.x = rng.standard_normal((n, 4)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"x": self.x[i], "y": i % 5, "w": i / 4, "tag": f"s{i}", "pid": os.getpid()}


def _heap_batches() -> list[str]:
    with NativeClient(session().transport.address) as c:
        return [t["name"] for t in c.admin("tensors") if t["name"].startswith("dl") and t["kind"] == "heap"]


def _drain(loader: DataLoader) -> None:
    for b in loader:
        del b  # so that a failure's traceback holds no batch


def _settle() -> None:
    gc.collect()
    dx.ones(1).numpy()  # a program, which carries the deletes of collected handles


@pytest.mark.parametrize("batch_size, drop_last, workers", [(8, False, 2), (8, True, 3), (37, False, 1), (5, False, 2)])
def test_workers_give_the_batches_of_no_workers_in_order(batch_size, drop_last, workers):
    def epoch(n):
        loader = DataLoader(Samples(), batch_size=batch_size, shuffle=True, drop_last=drop_last, num_workers=n,
                            generator=Generator().manual_seed(11))
        return [(b["x"].numpy(), b["y"].numpy(), b["w"].numpy(), b["tag"], b["x"].dtype, b["y"].dtype, b["w"].dtype)
                for b in loader]

    got, want = epoch(workers), epoch(0)
    assert len(got) == len(want) == len(DataLoader(Samples(), batch_size=batch_size, drop_last=drop_last))
    for g, w in zip(got, want):
        for a, b in zip(g[:3], w[:3]):
            np.testing.assert_array_equal(a, b)
        assert g[3:] == w[3:]
    assert got[0][4:] == ("float32", "int64", "float64")
    _settle()
    assert _heap_batches() == []  # every batch's heap tensors deleted once its handles went


def test_they_match_torch_workers():
    ours = [b["x"].numpy() for b in DataLoader(Samples(), batch_size=6, num_workers=2)]
    theirs = [b["x"].numpy() for b in tdata.DataLoader(Samples(), batch_size=6, num_workers=2)]
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)


def test_batches_are_made_in_other_processes_ahead_of_the_loop():
    loader = DataLoader(Samples(40), batch_size=4, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    first = next(it)
    pids = set(first["pid"].numpy().tolist())
    assert os.getpid() not in pids
    # while the loop holds batch 0, the workers make the next ones: batch 1's tensors appear without asking
    for _ in range(200):
        names = _heap_batches()
        if any(n.endswith("b1f0") for n in names):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"batch 1 was not made ahead of the loop: {names}")
    rest = list(it)
    assert len(rest) == 9
    every = pids | {int(p) for b in rest for p in b["pid"].numpy()}
    assert os.getpid() not in every and len(every) == 2  # batch k from worker k % 2
    del first, rest, it
    _settle()
    assert _heap_batches() == []


def test_persistent_workers_stay_across_epochs_and_others_do_not():
    def pids(loader):
        return {int(p) for b in loader for p in b["pid"].numpy()}

    keep = DataLoader(Samples(12), batch_size=4, num_workers=2, persistent_workers=True)
    first, second = pids(keep), pids(keep)
    assert first == second and len(first) == 2
    fresh = DataLoader(Samples(12), batch_size=4, num_workers=2)
    assert pids(fresh).isdisjoint(pids(fresh))
    del keep


def test_leaving_a_loop_early_deletes_what_was_made_ahead():
    loader = DataLoader(Samples(60), batch_size=4, num_workers=2, prefetch_factor=3)
    it = iter(loader)
    next(it)
    next(it)  # two batches read, more made ahead
    it.close()
    _settle()
    assert _heap_batches() == []


class Failing(Samples):
    def __getitem__(self, i: int):
        if i == 13:
            raise ValueError("sample 13 is corrupt")
        return super().__getitem__(i)


def test_a_workers_exception_is_raised_with_its_traceback():
    with pytest.raises(DeepxError, match=r"DataLoader worker \d failed on batch 3: ValueError: sample 13 is corrupt"
                       r"(.|\n)*in __getitem__"):
        _drain(DataLoader(Failing(), batch_size=4, num_workers=2))
    _settle()
    assert _heap_batches() == []
    assert [b["y"].shape for b in DataLoader(Samples(8), batch_size=4, num_workers=2)] == [(4,), (4,)]  # goes on


class Dying(Samples):
    def __getitem__(self, i: int):
        if i == 9:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


def test_a_worker_that_dies_is_named():
    with pytest.raises(DeepxError, match=r"DataLoader worker \d \(pid \d+\) exited unexpectedly \(exit code -9\)"):
        _drain(DataLoader(Dying(), batch_size=4, num_workers=2))
    _settle()
    assert _heap_batches() == []  # the live worker's batches made ahead were read and deleted


def test_uncollated_samples_and_a_collate_fn():
    samples = list(DataLoader(Samples(5), batch_size=None, num_workers=2))
    assert [s["tag"] for s in samples] == ["s0", "s1", "s2", "s3", "s4"]
    np.testing.assert_array_equal(samples[3]["x"].numpy(), Samples(5).x[3])
    assert samples[2]["y"].shape == () and samples[2]["y"].numpy() == 2

    def pairs(batch):
        return np.stack([b["x"] for b in batch]).sum(0), len(batch)

    got = list(DataLoader(Samples(10), batch_size=4, num_workers=2, collate_fn=pairs))
    np.testing.assert_allclose(got[0][0].numpy(), Samples(10).x[:4].sum(0), rtol=1e-6)
    assert [int(n.numpy()) for _, n in got] == [4, 4, 2]


def test_a_dataset_of_deepx_tensors_is_refused_by_workers_but_gathered_without_them():
    x = dx.tensor(np.arange(12, dtype=np.float32).reshape(6, 2))

    class OfTensors(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return x[i]

    with pytest.raises(DeepxError, match=r"cannot be batched on the host.*numpy arrays and numbers"):
        list(DataLoader(OfTensors(), batch_size=3, num_workers=1))
    ds = dx.utils.data.TensorDataset(x)
    (a,), (b,) = DataLoader(ds, batch_size=3, num_workers=2)  # a TensorDataset is gathered on the daemon
    np.testing.assert_array_equal(a.numpy(), np.arange(6, dtype=np.float32).reshape(3, 2))
    np.testing.assert_array_equal(b.numpy(), np.arange(6, 12, dtype=np.float32).reshape(3, 2))


def test_refusals():
    with pytest.raises(DeepxError, match="num_workers must be a non-negative integer, got -1"):
        DataLoader(Samples(), num_workers=-1)
    with pytest.raises(DeepxError, match="prefetch_factor and persistent_workers need num_workers > 0"):
        DataLoader(Samples(), prefetch_factor=2)
    with pytest.raises(DeepxError, match="timeout must be >= 0"):
        DataLoader(Samples(), num_workers=1, timeout=-1)


class Noisy(Samples):
    """A sample with random augmentation from the worker's global generators (numpy's), as datasets do."""

    def __getitem__(self, i: int):
        return np.random.random(2).astype(np.float32)


def test_workers_random_state_is_reproducible_and_new_each_epoch():
    def epochs(seed):
        loader = DataLoader(Noisy(8), batch_size=4, num_workers=2, shuffle=True,
                            generator=Generator().manual_seed(seed))
        return [np.concatenate([b.numpy() for b in loader]) for _ in range(2)]

    first, again = epochs(3), epochs(3)
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    assert not np.array_equal(first[0], first[1])  # a new draw each epoch, as torch's base seed


def test_a_worker_that_fails_part_way_through_a_batch_leaves_no_tensor():
    class HalfPut(Samples):
        def __getitem__(self, i: int):
            return np.zeros(3, np.float32), object() if i == 5 else 1  # the second field cannot be batched

    with pytest.raises(DeepxError, match="cannot be batched"):
        _drain(DataLoader(HalfPut(8), batch_size=4, num_workers=2, persistent_workers=True))
    _settle()
    assert _heap_batches() == []
