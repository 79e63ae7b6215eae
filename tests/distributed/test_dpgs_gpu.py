"""DPGS virtual nodes on one GPU (run on a GPU machine: ``pytest -m gpu tests/distributed/test_dpgs_gpu.py``).

P workers share one CUDA device through Ray's fractional GPUs (``dpgs.gpus_per_worker`` = 1/P):

* each worker is given 1/P of the GPU, and its CUDA caching allocator is capped at 1/P of the device's
  memory (``dpgs.distributed.gpu_share``); the peak it allocated in a step is reported and stays under
  the cap;
* one DPGS step (dense, SGD, bags of lengths 1..1000) on the shared GPU equals the single-process packed
  step on the same GPU;
* a worker whose share is too small for its step fails with an error that names its share and
  ``dpgs.gpus_per_worker``.
"""

from __future__ import annotations

import pytest
import ray
import torch

from dpgs.errors import RunFailure
from tests.distributed.test_dpgs_stacking import DENSE, EXACT, LENGTHS, assert_close, local_params, start
from tests.dpgs_helpers import dpgs_engine, experiment_data, make_config, write_bags

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.ray,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def gpu_ray():
    """A local Ray instance with this machine's one GPU (no dashboard)."""
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, object_store_memory=1 << 30)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def bags(tmp_path_factory):
    return write_bags(tmp_path_factory.mktemp("bags"), LENGTHS, dim=512)


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_share_one_gpu_and_one_step_equals_packed(gpu_ray, bags, tmp_path, workers):
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", f"dpgs.workers={workers}",
                         "train.device=cuda", *EXACT, *DENSE)
    data = experiment_data(config)
    batch = [[0, 1, 2, 3, 4, 5, 6]]
    reference = local_params(config, data, batch, device="cuda")
    cpu_reference = local_params(config, data, batch)
    spec, model = start(config, data)
    with dpgs_engine(config, spec, model, data.dataset, data.splits[0].train) as engine:
        where = [line for lines in ray.get(engine.group.workers.call("where")) for line in lines]
        stats = engine.run_epoch(batch, 1, [])
        stacked = {k: v.clone() for k, v in engine.state_dict().items()}
    assert len(where) == workers
    total = torch.cuda.get_device_properties(0).total_memory
    share = 1 / workers
    for line in where:
        assert "device=cuda" in line, line
        assert f"GPU={share:g}" in line, line
        assert f"cuda memory cap {share:g} x {total / (1 << 30):.1f} GiB" in line, line
    assert_close(stacked, reference, 1e-5)
    assert_close(stacked, cpu_reference, 1e-5)
    peak = stats["worker_peak_device_mib"] * (1 << 20)
    assert 0 < peak <= share * total


def test_a_worker_beyond_its_share_fails_naming_it(gpu_ray, bags, tmp_path):
    """A share of 1/10000 of the device (8-14 MiB on an 80-141 GiB card) cannot hold a bag of 1000
    instances of 512 features (2 MB, which the caching allocator serves from a 20 MiB segment)."""
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2", "train.device=cuda",
                         "dpgs.gpus_per_worker=0.0001", *EXACT, *DENSE)
    data = experiment_data(config)
    spec, model = start(config, data)
    expected = r"ran out of its share of the GPU .*dpgs\.gpus_per_worker=0\.0001\)"
    with pytest.raises(RunFailure, match=expected):
        with dpgs_engine(config, spec, model, data.dataset, data.splits[0].train) as engine:
            engine.run_epoch([[1, 6, 4, 13, 0, 2, 3, 5]], 1, [])
