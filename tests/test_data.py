"""Per-rank batch sampler, synthetic datasets, and MNIST / CIFAR-10 read from real-format files."""

import io
import os
import pickle
import struct

import numpy as np
import pytest
import torch
import torchvision
from torch.utils.data import TensorDataset

from trainer.data.datasets import (
    GlobalBatchSampler,
    cifar10,
    make_loader,
    mnist,
    synthetic_classification,
    synthetic_images,
    synthetic_tokens,
)
from trainer.errors import ConfigError

# --------------------------------------------------------------------------------------
# GlobalBatchSampler / make_loader


def _take(it, k):
    return [next(it) for _ in range(k)]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("drop_last", [True, False])
def test_rank_slices_concatenate_to_the_single_process_batch(world_size, drop_last):
    n, global_batch, steps = 50, 8, 20  # 6 or 7 batches per epoch: crosses epoch boundaries
    single = _take(
        iter(GlobalBatchSampler(n, global_batch, 0, 1, seed=3, drop_last=drop_last)), steps
    )
    ranks = [
        _take(iter(GlobalBatchSampler(n, global_batch, r, world_size, 3, drop_last)), steps)
        for r in range(world_size)
    ]
    for s in range(steps):
        parts = [ranks[r][s] for r in range(world_size)]
        assert all(len(p) == global_batch // world_size for p in parts)
        for a in range(world_size):  # disjoint within a step
            for b in range(a + 1, world_size):
                assert not set(parts[a]) & set(parts[b])
        assert sum(parts, []) == single[s]


def test_loader_batches_concatenate_to_the_single_process_batch():
    x = torch.arange(40).float().unsqueeze(1)  # (40, 1): sample i holds value i
    dataset = TensorDataset(x, torch.arange(40))
    single = _take(iter(make_loader(dataset, 12, rank=0, world_size=1, seed=0)), 7)
    ranks = [_take(iter(make_loader(dataset, 12, r, 3, seed=0)), 7) for r in range(3)]
    for s in range(7):
        xs = torch.cat([ranks[r][s][0] for r in range(3)])  # (12, 1)
        ys = torch.cat([ranks[r][s][1] for r in range(3)])  # (12,)
        assert xs.shape == (12, 1)
        torch.testing.assert_close(xs, single[s][0])
        torch.testing.assert_close(ys, single[s][1])


def test_epochs_differ_and_cover_the_dataset():
    sampler = GlobalBatchSampler(32, 8, 0, 1, seed=0)
    batches = _take(iter(sampler), 8)  # two epochs of 4 batches
    epoch0, epoch1 = sum(batches[:4], []), sum(batches[4:], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(32))
    assert epoch0 != epoch1


def test_same_seed_same_order_other_seed_other_order():
    a = _take(iter(GlobalBatchSampler(100, 10, 1, 2, seed=7)), 15)
    b = _take(iter(GlobalBatchSampler(100, 10, 1, 2, seed=7)), 15)
    c = _take(iter(GlobalBatchSampler(100, 10, 1, 2, seed=8)), 15)
    assert a == b
    assert a != c


def test_drop_last_false_fills_the_last_batch():
    sampler = GlobalBatchSampler(10, 4, 0, 1, seed=0, drop_last=False)
    assert sampler.batches_per_epoch == 3
    epoch = _take(iter(sampler), 3)
    assert all(len(b) == 4 for b in epoch)
    assert set(sum(epoch, [])) == set(range(10))
    assert GlobalBatchSampler(10, 4, 0, 1, seed=0).batches_per_epoch == 2


@pytest.mark.parametrize("consumed", [0, 3, 5, 6, 11])
def test_state_dict_resume_continues_exactly(consumed):
    n, global_batch = 30, 6  # 5 batches per epoch
    reference = _take(iter(GlobalBatchSampler(n, global_batch, 1, 2, seed=4)), 15)

    first = GlobalBatchSampler(n, global_batch, 1, 2, seed=4)
    it = iter(first)
    assert _take(it, consumed) == reference[:consumed]
    state = first.state_dict()
    assert state["epoch"] * 5 + state["batch_in_epoch"] == consumed

    resumed = GlobalBatchSampler(n, global_batch, 1, 2, seed=4)
    resumed.load_state_dict(state)
    assert _take(iter(resumed), 15 - consumed) == reference[consumed:]

    sought = GlobalBatchSampler(n, global_batch, 1, 2, seed=4)
    sought.seek(consumed)
    assert _take(iter(sought), 15 - consumed) == reference[consumed:]


def test_state_resumes_under_another_world_size():
    # The position is counted in global batches, so 2 ranks can continue a 1-rank run.
    one = GlobalBatchSampler(40, 8, 0, 1, seed=1)
    reference = _take(iter(one), 9)
    state = GlobalBatchSampler(40, 8, 0, 1, seed=1)
    _take(iter(state), 6)
    continued = []
    for r in range(2):
        s = GlobalBatchSampler(40, 8, r, 2, seed=1)
        s.load_state_dict(state.state_dict())
        continued.append(_take(iter(s), 3))
    assert [continued[0][i] + continued[1][i] for i in range(3)] == reference[6:]


def test_state_from_another_configuration_is_refused():
    state = GlobalBatchSampler(40, 8, 0, 1, seed=1).state_dict()
    with pytest.raises(ConfigError, match="global_batch=8.*global_batch=4"):
        GlobalBatchSampler(40, 4, 0, 1, seed=1).load_state_dict(state)


def test_sampler_config_errors_name_the_values():
    with pytest.raises(ConfigError, match="global batch 10 is not divisible by world size 4"):
        GlobalBatchSampler(100, 10, 0, 4, seed=0)
    with pytest.raises(ConfigError, match="global batch 64 is larger than the dataset \\(50"):
        GlobalBatchSampler(50, 64, 0, 2, seed=0)
    with pytest.raises(ConfigError, match="rank 2 .* world size 2"):
        GlobalBatchSampler(50, 8, 2, 2, seed=0)


# --------------------------------------------------------------------------------------
# Synthetic datasets


def test_synthetic_datasets_shapes_and_determinism():
    torch.manual_seed(123)
    a = synthetic_classification(n=64, in_dim=12, num_classes=5, seed=1)
    torch.manual_seed(456)  # the global RNG must not matter
    b = synthetic_classification(n=64, in_dim=12, num_classes=5, seed=1)
    assert a.tensors[0].shape == (64, 12) and a.tensors[0].dtype == torch.float32
    assert a.tensors[1].shape == (64,) and a.tensors[1].dtype == torch.int64
    assert int(a.tensors[1].max()) < 5
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        torch.testing.assert_close(ta, tb)
    other_seed = synthetic_classification(n=64, in_dim=12, num_classes=5, seed=2)
    held_out = synthetic_classification(n=64, in_dim=12, num_classes=5, seed=1, train=False)
    assert not torch.equal(a.tensors[0], other_seed.tensors[0])
    assert not torch.equal(a.tensors[0], held_out.tensors[0])

    images = synthetic_images(n=6, channels=3, size=16, num_classes=4)
    assert images.tensors[0].shape == (6, 3, 16, 16) and images.tensors[1].shape == (6,)
    torch.testing.assert_close(images.tensors[0], synthetic_images(6, 3, 16, 4).tensors[0])


def test_synthetic_held_out_split_shares_the_distribution():
    # Class means estimated on train and on the held-out split agree: same clusters.
    train = synthetic_classification(n=4096, num_classes=4, seed=0)
    test = synthetic_classification(n=4096, num_classes=4, seed=0, train=False)
    for k in range(4):
        mean_train = train.tensors[0][train.tensors[1] == k].mean(0)
        mean_test = test.tensors[0][test.tensors[1] == k].mean(0)
        torch.testing.assert_close(mean_train, mean_test, atol=0.15, rtol=0)


def test_synthetic_tokens_targets_are_inputs_shifted():
    ds = synthetic_tokens(n=16, block_size=10, vocab_size=20, seed=0)
    inputs, targets = ds.tensors
    assert inputs.shape == targets.shape == (16, 10)
    assert inputs.dtype == targets.dtype == torch.int64
    assert int(inputs.max()) < 20 and int(inputs.min()) >= 0
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
    x, y = ds[0]
    assert y.shape == (10,)
    # Low entropy: every token is followed by at most 2 distinct tokens.
    big = synthetic_tokens(n=512, block_size=10, vocab_size=20, seed=0).tensors
    pairs = torch.stack([big[0].flatten(), big[1].flatten()], 1).unique(dim=0)
    assert max(int((pairs[:, 0] == t).sum()) for t in range(20)) <= 2


# --------------------------------------------------------------------------------------
# MNIST in its real on-disk format: idx files, big-endian int32 header, uint8 payload.


def _write_idx(path, magic: int, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack(">i", magic))  # 2051 images (ubyte, 3 dims), 2049 labels (1 dim)
        f.write(struct.pack(f">{array.ndim}i", *array.shape))
        f.write(array.astype(np.uint8).tobytes())


@pytest.fixture
def mnist_root(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for prefix, n in (("train", 5), ("t10k", 3)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", 2051, images)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", 2049, labels)
        written[prefix] = (images, labels)
    return tmp_path, written


@pytest.mark.parametrize("train", [True, False])
def test_mnist_reads_back_what_was_written(mnist_root, train):
    root, written = mnist_root
    images, labels = written["train" if train else "t10k"]
    ds = mnist(str(root), train=train)
    assert len(ds) == len(labels)
    for i in range(len(labels)):
        x, y = ds[i]
        assert x.shape == (1, 28, 28) and x.dtype == torch.float32
        pixels = (x * 0.3081 + 0.1307) * 255  # undo Normalize and ToTensor
        torch.testing.assert_close(
            pixels[0], torch.from_numpy(images[i]).float(), atol=1e-3, rtol=0
        )
        assert y == int(labels[i])


# --------------------------------------------------------------------------------------
# CIFAR-10 in its real on-disk format: Python 2 pickles of dicts whose keys are Python 2
# `str` (read back as b"data" with encoding="bytes", as "data" with encoding="latin1",
# which torchvision uses), b"data" a uint8 (N, 3072) array of R, G, B planes, b"labels" a
# list of ints.


class _Py2Pickler(pickle._Pickler):
    """Protocol 2 pickler that writes bytes as Python 2 `str` (BINSTRING opcodes)."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_str(self, obj: bytes) -> None:
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + struct.pack("<B", len(obj)) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str


def _write_py2_pickle(path, obj) -> None:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    path.write_bytes(buf.getvalue())


@pytest.fixture
def cifar_root(tmp_path, monkeypatch):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(1)
    written = {}
    names = ["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5"]
    for name in names + ["test_batch"]:
        data = rng.integers(0, 256, (2, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, 2)]
        batch = {b"batch_label": name.encode(), b"labels": labels, b"data": data}
        _write_py2_pickle(folder / name, batch)
        written[name] = (data, labels)
    classes = [b"airplane", b"automobile", b"bird", b"cat", b"deer"]
    classes += [b"dog", b"frog", b"horse", b"ship", b"truck"]
    meta = {b"num_cases_per_batch": 10000, b"label_names": classes, b"num_vis": 3072}
    _write_py2_pickle(folder / "batches.meta", meta)
    # torchvision compares each file's md5 with the real CIFAR-10's. Keep its check that
    # the file exists, skip the checksum; parsing stays torchvision's own.
    monkeypatch.setattr(
        torchvision.datasets.cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath)
    )
    return tmp_path, written


def test_cifar_fixture_is_in_the_python2_format(cifar_root):
    root, written = cifar_root
    with open(root / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        entry = pickle.load(f, encoding="bytes")  # how the CIFAR-10 page says to read it
    assert set(entry) == {b"batch_label", b"labels", b"data"}
    np.testing.assert_array_equal(entry[b"data"], written["data_batch_1"][0])


@pytest.mark.parametrize("train", [True, False])
def test_cifar10_reads_back_what_was_written(cifar_root, train):
    root, written = cifar_root
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    data = np.concatenate([written[n][0] for n in names])  # (N, 3072)
    labels = sum((written[n][1] for n in names), [])
    ds = cifar10(str(root), train=train)
    assert len(ds) == len(labels)
    assert ds.classes[0] == "airplane"
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    for i in range(len(labels)):
        x, y = ds[i]
        assert x.shape == (3, 32, 32)
        pixels = (x * std + mean) * 255
        expected = torch.from_numpy(data[i].reshape(3, 32, 32)).float()  # R, G, B planes
        torch.testing.assert_close(pixels, expected, atol=1e-3, rtol=0)
        assert y == labels[i]


def test_missing_files_raise_config_error_naming_the_root(tmp_path):
    missing = tmp_path / "no_such_dir"
    for build in (mnist, cifar10):
        with pytest.raises(ConfigError) as info:
            build(str(missing), train=True, download=False)
        message = str(info.value)
        assert str(missing) in message and "data.download=true" in message
        assert "\n" not in message
        assert info.value.__cause__ is None and info.value.__suppress_context__
