"""deepx_sdk.utils.data against torch.utils.data: the same batches in order, reproducible shuffles, the edges."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.data as tdata

import deepx_sdk as dx
from deepx_core.errors import DeepxError
from deepx_sdk.utils.data import DataLoader, Dataset, Generator, Subset, TensorDataset, default_collate, random_split


def _xy(n=23):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 3)).astype(np.float32), rng.integers(0, 5, n).astype(np.int64)


@pytest.mark.parametrize("batch_size, drop_last", [(4, False), (4, True), (23, False), (30, False), (1, False)])
def test_tensor_dataset_batches_in_order_as_torch(batch_size, drop_last):
    x, y = _xy()
    ours = DataLoader(TensorDataset(dx.tensor(x), dx.tensor(y)), batch_size=batch_size, drop_last=drop_last)
    theirs = tdata.DataLoader(tdata.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=batch_size,
                              drop_last=drop_last)
    assert len(ours) == len(theirs)
    got, want = list(ours), list(theirs)
    assert len(got) == len(want)
    for (bx, by), (tx, ty) in zip(got, want):
        assert (bx.dtype, by.dtype) == ("float32", "int64")
        np.testing.assert_array_equal(bx.numpy(), tx.numpy())
        np.testing.assert_array_equal(by.numpy(), ty.numpy())


def test_a_shuffle_is_reproducible_and_covers_every_sample_once():
    x, y = _xy()
    ds = TensorDataset(dx.tensor(x), dx.tensor(y))

    def epoch(loader):
        return np.concatenate([bx.numpy()[:, 0] for bx, _ in loader])

    a = DataLoader(ds, batch_size=5, shuffle=True, generator=Generator().manual_seed(7))
    b = DataLoader(ds, batch_size=5, shuffle=True, generator=dx.Generator().manual_seed(7))  # torch's spelling
    first, again = epoch(a), epoch(b)
    np.testing.assert_array_equal(first, again)
    assert sorted(first) == sorted(x[:, 0]) and not np.array_equal(first, x[:, 0])
    assert not np.array_equal(epoch(a), first)  # a new order each epoch
    dx.manual_seed(3)
    one = epoch(DataLoader(ds, batch_size=5, shuffle=True))
    dx.manual_seed(3)
    np.testing.assert_array_equal(one, epoch(DataLoader(ds, batch_size=5, shuffle=True)))  # from dx.manual_seed
    rows = {tuple(r) for r in x}
    for bx, by in DataLoader(ds, batch_size=6, shuffle=True, generator=np.random.default_rng(1)):
        for r, label in zip(bx.numpy(), by.numpy()):  # each row keeps its label
            assert tuple(r) in rows and y[np.where((x == r).all(axis=1))[0][0]] == label


class Squares(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": np.array([i, i * i], np.float32), "n": i, "w": float(i) / 2, "tag": f"s{i}"}


def test_a_map_dataset_collates_as_torch():
    batches = list(DataLoader(Squares(), batch_size=4))
    tb = list(tdata.DataLoader(Squares(), batch_size=4))
    assert len(batches) == 3
    for got, want in zip(batches, tb):
        np.testing.assert_array_equal(got["x"].numpy(), want["x"].numpy())
        assert got["x"].dtype == "float32" and got["n"].dtype == "int64" and got["w"].dtype == "float64"
        assert str(want["n"].dtype) == "torch.int64" and str(want["w"].dtype) == "torch.float64"
        np.testing.assert_array_equal(got["n"].numpy(), want["n"].numpy())
        np.testing.assert_array_equal(got["w"].numpy(), want["w"].numpy())
        assert got["tag"] == list(want["tag"])
    samples = list(DataLoader(Squares(), batch_size=None))
    assert len(samples) == 10 and samples[3]["n"] == 3  # uncollated


def test_collate_of_tensors_and_tuples():
    a, b = dx.tensor(np.ones((2, 3), np.float32)), dx.tensor(np.zeros((2, 3), np.float32))
    out = default_collate([(a, 1), (b, 2)])
    assert isinstance(out, tuple) and out[0].shape == (2, 2, 3) and out[1].numpy().tolist() == [1, 2]
    with pytest.raises(DeepxError, match="different numbers of fields"):
        default_collate([(1, 2), (1,)])
    with pytest.raises(DeepxError, match="cannot batch samples of type object"):
        default_collate([object()])


def test_random_split_and_subsets():
    x, y = _xy(20)
    ds = TensorDataset(dx.tensor(x), dx.tensor(y))
    train, test = random_split(ds, [15, 5], generator=Generator().manual_seed(0))
    assert (len(train), len(test)) == (15, 5)
    assert sorted(train.indices + test.indices) == list(range(20))
    parts = random_split(ds, [0.5, 0.3, 0.2], generator=Generator().manual_seed(0))
    assert [len(p) for p in parts] == [10, 6, 4]
    sub = Subset(ds, [3, 1, 4])
    (bx, by), = list(DataLoader(sub, batch_size=3))  # gathered on the daemon through the subset
    np.testing.assert_array_equal(bx.numpy(), x[[3, 1, 4]])
    np.testing.assert_array_equal(by.numpy(), y[[3, 1, 4]])
    np.testing.assert_array_equal(sub[2][1].numpy(), y[4])
    with pytest.raises(DeepxError, match="the lengths sum to 19, the dataset has 20 samples"):
        random_split(ds, [10, 9])


def test_refusals_name_the_problem():
    with pytest.raises(DeepxError, match="share their first dimension"):
        TensorDataset(dx.tensor(np.zeros((3, 2))), dx.tensor(np.zeros(4)))
    ds = TensorDataset(dx.tensor(np.zeros((3, 2))))
    with pytest.raises(DeepxError, match="batch_size must be a positive integer or None, got 0"):
        DataLoader(ds, batch_size=0)
    with pytest.raises(DeepxError, match="generator must be"):
        DataLoader(ds, shuffle=True, generator=42)


def test_a_training_loop_over_a_loader_learns():
    """A linear classifier over shuffled minibatches: the loss falls, as a torch user's loop expects."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((256, 8)).astype(np.float32)
    y = (x @ rng.standard_normal(8) > 0).astype(np.int64)
    loader = DataLoader(TensorDataset(dx.tensor(x), dx.tensor(y)), batch_size=32, shuffle=True,
                        generator=Generator().manual_seed(0))
    model = dx.nn.Linear(8, 2)
    opt = dx.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        total = 0.0
        for bx, by in loader:
            loss = dx.nn.functional.cross_entropy(model(bx), by)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss)
        losses.append(total / len(loader))
    assert losses[-1] < losses[0] * 0.6
