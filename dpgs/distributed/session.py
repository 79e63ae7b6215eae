"""The DPGS session: Ray, the actors and their group, started once for every fold of a ``dpgs train``
command (``train.mode=dpgs``); each fold only resets the actors' state (``DpgsEngine``)."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dpgs.config import Config
from dpgs.distributed.actors import Bundle, PlacedActors, StartCall, release_named
from dpgs.distributed.dpgs_engine import DpgsEngine
from dpgs.distributed.failures import ray_failures
from dpgs.distributed.rank_group import RankGroup
from dpgs.distributed.roles import Roles, WorkerLaunch
from dpgs.distributed.runtime import connect
from dpgs.distributed.schedule import AutoMeasurements
from dpgs.runwatch import WATCHER
from dpgs.train.engine import FoldSetup


def start_workers(roles: Roles, config: Config, spec, dataset, launch: WorkerLaunch) -> PlacedActors:
    """The P worker actors of ``roles.worker`` started as ``launch`` says, each given ``dataset`` (by
    ``Worker.read_from``, again after a restart: :class:`StartCall`); prints where each runs."""
    cfg = config.dpgs
    workers = None
    try:
        workers = PlacedActors(
            roles.worker,
            cfg.workers,
            lambda w: (w, spec, config, launch.device, launch.threads),
            bundle=Bundle(launch.cpus, launch.gpus),
            placed=launch.placed,
            max_restarts=cfg.max_worker_restarts,
            timeout_s=cfg.call_timeout_s,
            kwargs_of=lambda w: launch.kwargs[w] if launch.kwargs else {},
            start_call=StartCall("read_from", dataset),
        )
        where = workers.get(workers.call("where"))
    except BaseException:  # workers that could not start: leave nothing behind
        if workers is not None:
            workers.close()
        if launch.reservation_prefix:
            release_named(launch.reservation_prefix)
        raise
    for lines in where:
        for line in lines:
            print(f"[dpgs] {line}", flush=True)
    return workers


class DpgsSession:
    """Starts Ray and the actors with the first fold; later folds only reset the actors' state, and start
    from what ``keep_ratio=auto`` measured in the folds before them (:class:`AutoMeasurements`).

    ``roles``: the master and worker classes (``dpgs.runner.dpgs_roles``)."""

    def __init__(self, config: Config, roles: Roles):
        self.config = config
        self.roles = roles
        self.group: RankGroup | None = None
        self.launch: WorkerLaunch | None = None
        self.head_watched = False
        self.connected = False  # this session started (or joined) Ray: it disconnects when it closes
        self.measured = AutoMeasurements()  # keep_ratio=auto's figures, for every fold

    def _start(self, setup: FoldSetup) -> RankGroup:
        config = setup.config
        self.connected = connect(config.dpgs)
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self.launch = self.roles.worker.launch(config)
        master = (  # starts while the workers start
            ray.remote(self.roles.master)
            .options(num_cpus=0, max_restarts=0, max_task_retries=0, scheduling_strategy=here)
            .remote(setup.spec, config, self.launch.threads)
        )
        try:
            with ray_failures("the DPGS workers could not start (is dpgs installed alike on every node?)"):
                workers = start_workers(self.roles, config, setup.spec, setup.dataset, self.launch)
        except BaseException:
            ray.kill(master, no_restart=True)
            raise
        try:
            group = RankGroup(config.dpgs, master, workers, here)
        except BaseException:
            ray.kill(master, no_restart=True)
            workers.close()
            raise
        if config.dpgs.address:  # a cluster head this process does not own: the run watcher watches it
            WATCHER.watch_head(group.watch.address,
                               f"resume from the last checkpoint in {config.train.output_dir} with --resume")
            self.head_watched = True
        return group

    def engine(self, setup: FoldSetup) -> DpgsEngine:
        if self.group is None:
            self.group = self._start(setup)
        return DpgsEngine(self.group, setup, self.measured)

    def close(self) -> None:
        """Release the group, then Ray where this session connected it: a local instance stops, a cluster
        is left (at once: Ray's own exit hook would first wait 0.5 s for log lines). With the cluster's head
        lost, Ray is left to the exit hook, as it was."""
        lost = False
        if self.group is not None:
            self.group.close()
            lost = self.group.watch.lost
            # reservations of workers that died without closing (none reachable once the cluster is lost)
            if self.launch.reservation_prefix and not lost:
                release_named(self.launch.reservation_prefix)
            if self.head_watched and not lost:  # watched until released: a release that blocks inside Ray
                WATCHER.head_closed()  # (the head lost meanwhile) ends at 40 s
            self.group = None
        if self.connected and not lost:
            ray.shutdown()
        self.connected = False
