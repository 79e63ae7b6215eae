"""Sample parallelism: one huge input split over G ranks with halo exchange (see ``docs/spatial.md``).

``partition`` (grid, ownership, halo plans), ``halo`` (halo exchange / gather as autograd functions),
``layers`` (distributed conv, exact BatchNorm, max pooling), ``model`` (sample-parallel ResNet-18/50),
``rank`` (one rank's step), ``group`` (the Ray actors and their fault handling), ``sources``
(inputs read by rectangle).
"""

from dpgs.spatial.halo import CommMeter, GatherToRoot, HaloExchange, SpatialContext
from dpgs.spatial.model import SampleParallelResNet
from dpgs.spatial.partition import Grid, HaloPlan, Partition, Rect, make_grid
from dpgs.spatial.rank import RankState, SpatialModelSpec

__all__ = [
    "CommMeter",
    "GatherToRoot",
    "Grid",
    "HaloExchange",
    "HaloPlan",
    "Partition",
    "RankState",
    "Rect",
    "SampleParallelResNet",
    "SpatialContext",
    "SpatialModelSpec",
    "make_grid",
]
