import pickle
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import dpgs.data.dataset as dataset_module
from dpgs.data import BagDataset, ByteLRUCache, Prefetcher, SlideRecord
from tests.data_helpers import write_h5, write_pt


def records_for(tmp_path: Path, n=6, length=10, d=8, dtype=np.float16):
    recs = []
    for i in range(n):
        path = tmp_path / f"s{i}.h5"
        write_h5(path, n=length + i, d=d, dtype=dtype, seed=i)
        recs.append(SlideRecord(f"s{i}", i % 2, str(i % 2), f"s{i}", None, path))
    return recs


def test_bags_are_float32_with_coords_and_labels(tmp_path):
    recs = records_for(tmp_path)
    pt = tmp_path / "p.pt"
    ref = write_pt(pt, n=3, d=8, dtype=torch.float16)
    recs.append(SlideRecord("p", 1, "1", "p", None, pt))
    ds = BagDataset(recs)
    bag = ds[2]
    assert bag.slide_id == "s2" and bag.label == 0
    assert bag.features.dtype == torch.float32 and bag.features.shape == (12, 8)
    assert torch.equal(
        bag.features,
        torch.from_numpy(write_h5(tmp_path / "x.h5", n=12, d=8, dtype=np.float16, seed=2)).float(),
    )
    assert bag.coords.shape == (12, 2)
    assert ds[6].coords is None and torch.equal(ds[6].features, ref.float())
    assert ds.feature_dim == 8 and len(ds) == 7


def test_lengths_come_from_metadata_without_loading(tmp_path, monkeypatch):
    ds = BagDataset(records_for(tmp_path))

    def fail(path):
        raise AssertionError(f"features of {path} were read")

    monkeypatch.setattr(dataset_module, "read_bag", fail)
    assert ds.lengths() == [10, 11, 12, 13, 14, 15]
    assert ds.feature_dim == 8


def test_cache_respects_its_byte_bound(tmp_path, monkeypatch):
    recs = records_for(tmp_path, n=6, length=100, d=16, dtype=np.float16)
    per_bag = [(100 + i) * 16 * 2 + (100 + i) * 2 * 8 for i in range(6)]  # fp16 features + int64 coords
    bound = per_bag[0] + per_bag[1] + per_bag[2] + 10
    ds = BagDataset(recs, cache_bytes=bound)
    reads = []
    real = dataset_module.read_bag
    monkeypatch.setattr(dataset_module, "read_bag", lambda p: reads.append(Path(p).stem) or real(p))
    for i in range(6):
        ds[i]
        assert ds.cache.nbytes <= bound
    assert ds.cache.nbytes == per_bag[4] + per_bag[5]  # s3 pushed s0..s2 out, s4 pushed s3, ...
    ds[5]
    ds[4]
    assert reads == ["s0", "s1", "s2", "s3", "s4", "s5"]  # s4, s5 were cache hits
    ds[0]
    assert reads[-1] == "s0" and "s4" in ds.cache and "s5" not in ds.cache  # LRU: s5 was used before s4


def test_cache_never_stores_oversized_values_and_zero_disables():
    cache = ByteLRUCache(100)
    cache.put("big", object(), 101)
    assert "big" not in cache and cache.nbytes == 0
    cache.put("a", 1, 60)
    cache.put("a", 2, 40)
    assert cache.get("a") == 2 and cache.nbytes == 40
    off = ByteLRUCache(0)
    off.put("x", 1, 1)
    assert len(off) == 0
    with pytest.raises(ValueError):
        ByteLRUCache(-1)


def test_concurrent_access_is_consistent(tmp_path):
    recs = records_for(tmp_path, n=8, length=50, d=4, dtype=np.float32)
    ds = BagDataset(recs, cache_bytes=3 * 50 * 4 * 4)
    expected = [ds[i].features.clone() for i in range(8)]
    errors = []

    def hammer(seed):
        rng = np.random.default_rng(seed)
        for i in rng.integers(0, 8, size=200):
            if not torch.equal(ds[int(i)].features, expected[int(i)]):
                errors.append(int(i))

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and ds.cache.nbytes <= ds.cache.max_bytes


def test_dataset_pickles_without_its_cache(tmp_path):
    ds = BagDataset(records_for(tmp_path, n=2))
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert len(clone.cache) == 0 and clone.lengths() == ds.lengths()
    assert torch.equal(clone[1].features, ds[1].features)


class SlowDataset:
    def __init__(self, delay, fail_at=None):
        self.delay, self.fail_at = delay, fail_at

    def get(self, i, epoch):
        time.sleep(self.delay)
        if i == self.fail_at:
            raise OSError(f"disk error at {i}")
        return i


def test_prefetcher_overlaps_loading_with_compute():
    batches = [[2 * b, 2 * b + 1] for b in range(8)]  # 8 batches x 2 items x 25 ms = 0.4 s of loading
    start = time.perf_counter()
    seen = []
    for batch in Prefetcher(SlowDataset(0.025), batches, depth=2):
        time.sleep(0.05)  # 8 x 50 ms = 0.4 s of "compute"
        seen.extend(batch)
    overlapped = time.perf_counter() - start
    start = time.perf_counter()
    for _ in Prefetcher(SlowDataset(0.025), batches, depth=0):
        time.sleep(0.05)
    serial = time.perf_counter() - start
    assert seen == list(range(16))
    assert serial > 0.75
    assert overlapped < 0.65 and overlapped < 0.8 * serial


def test_prefetcher_propagates_errors_in_order():
    got = []
    with pytest.raises(OSError, match="disk error at 5"):
        for batch in Prefetcher(SlowDataset(0.0, fail_at=5), [[i] for i in range(10)], depth=3):
            got.extend(batch)
    assert got == [0, 1, 2, 3, 4]
    with pytest.raises(OSError, match="disk error at 1"):
        list(Prefetcher(SlowDataset(0.0, fail_at=1), [[0], [1]], depth=0))


def test_prefetcher_stops_its_thread_on_early_exit():
    prefetcher = Prefetcher(SlowDataset(0.001), ([i] for i in range(10_000)), depth=2)
    it = iter(prefetcher)
    assert next(it) == [0]
    thread = prefetcher._thread
    assert thread.is_alive()
    it.close()  # what a `break` out of a for loop does once the generator is released
    assert not thread.is_alive()
    with Prefetcher(SlowDataset(0.0), [[1], [2]]) as p:
        for batch in p:
            assert batch == [1]
            break
    assert p._thread is None
    with pytest.raises(RuntimeError, match="only once"):
        list(p)


def test_a_worker_unpickles_its_dataset_without_importing_scikit_learn(tmp_path):
    """A DPGS worker gets the dataset pickled and imports ``dpgs.data`` to unpickle it: that must not pull
    in scikit-learn, SciPy or pandas (only the driver's k-fold splits use them: ~1 s of CPU in every
    worker at start-up)."""
    import subprocess
    import sys

    (tmp_path / "ds.pkl").write_bytes(pickle.dumps(BagDataset(records_for(tmp_path, n=2))))
    code = ("import pickle, sys; import dpgs.workers.bag, dpgs.master.master; "
            f"ds = pickle.loads(open({str(tmp_path / 'ds.pkl')!r}, 'rb').read()); "
            "print(len(ds), ds[1].features.shape[0], *sorted(m for m in ('sklearn', 'scipy', 'pandas') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2", "11"]
