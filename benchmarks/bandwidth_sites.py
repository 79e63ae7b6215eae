"""Where the bandwidth benchmark's rows run, and how their traffic is counted.

* :class:`LabSite`: the multi-host lab (``tests/lab/netlab.py``): a Ray cluster of the head (the DPGS
  driver and master, ``--num-cpus=0``) and one node per worker host (``--num-cpus=1``), every host's link
  shaped to one rate with tc (tbf: this kernel has no netem; a worker link's delay, ``100mbit+1ms``, comes
  from the lab's delay line, ``tests/lab/delay.py``) or the worker hosts' links only; DDP ranks run one per
  worker host, the rendezvous on worker 1.
* :class:`LoopbackSite`: one host, no lab: every process of a row on this machine, inside a private
  network namespace (``unshare --net``, brought up by ``benchmarks/bandwidth.py``), so that the loopback's
  counters hold only the row's traffic.

:class:`CounterSampler` reads the byte counters of an interface of another network namespace through
``/proc/<pid>/net/dev`` of a process inside it (every 50 ms, in a thread) and interpolates them at any
wall-clock time, so the traffic of a window of steps (their ``time.time()`` bounds, recorded by the
driver or the DDP rank) is the difference of two interpolated counters.

A site also measures its *idle* traffic (:meth:`LabSite.idle_bytes_per_second`): the wire bytes per second
of the running cluster with no job on it (Ray's own heartbeats, resource reports and metrics). It flows
during a row's steps too, whether or not dpgs exchanges anything, so a row reports it beside the wire bytes:
on the tile workload's multi-second steps at keep 0.1 % it is most of the gap between the wire and dpgs's
count (on a 30 ms step it is next to nothing).

Most of it was one source (per-socket counts, ``ss -ti`` in the worker hosts, 2026-11-26): every node's
dashboard agent publishes its node's physical stats (a JSON of every Ray process's CPU and memory, 28 kB)
to the GCS every 5 s, for a dashboard that the lab does not run. The lab's Ray therefore starts with
``REPORTER_UPDATE_INTERVAL_MS`` at ``NODE_STATS_INTERVAL_MS`` (60 s), as a cluster on slow links should
(docs/cluster.md); Ray's heartbeats and resource reports are untouched.
"""

from __future__ import annotations

import bisect
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.lab.netlab

from dpgs.distributed.runtime import RAY_NODE_ENV  # noqa: E402
from tests.lab.netlab import Lab, LabError  # noqa: E402

RAY_PORT = 6379
DDP_PORT = 29533
IDLE_WINDOW_S = 10.0  # how long a site's idle traffic is measured before a link's rows
OBJECT_STORE_BYTES = 600 << 20
NODE_STATS_INTERVAL_MS = 60_000  # Ray's dashboard agents publish node stats this often (Ray's default: 5 s)


def read_counters(pid: int, device: str) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of ``device`` in the network namespace of process ``pid``."""
    for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]:
        name, _, fields = line.partition(":")
        if name.strip() == device:
            values = fields.split()
            return int(values[0]), int(values[8])
    raise LabError(f"no interface {device} in the network namespace of pid {pid}")


class CounterSampler:
    """Samples ``sources`` (name -> (pid, device)) every ``period`` seconds while running."""

    def __init__(self, sources: dict[str, tuple[int, str]], period: float = 0.05):
        self.sources = sources
        self.period = period
        self.times: list[float] = []
        self.values: list[dict[str, tuple[int, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        values = {name: read_counters(pid, dev) for name, (pid, dev) in self.sources.items()}
        self.times.append(time.time())
        self.values.append(values)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period)

    def __enter__(self) -> CounterSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def at(self, t: float) -> dict[str, tuple[float, float]]:
        """Counters at wall-clock ``t``, linearly interpolated between the samples around it."""
        if not self.times or not self.times[0] <= t <= self.times[-1]:
            raise ValueError(f"time {t:.3f} is outside the sampled span")
        i = bisect.bisect_left(self.times, t)
        if self.times[i] == t or i == 0:
            return {k: (float(v[0]), float(v[1])) for k, v in self.values[i].items()}
        t0, t1 = self.times[i - 1], self.times[i]
        a, b = self.values[i - 1], self.values[i]
        f = (t - t0) / (t1 - t0)
        return {k: (a[k][0] + f * (b[k][0] - a[k][0]), a[k][1] + f * (b[k][1] - a[k][1])) for k in a}

    def gap_at(self, t: float) -> float:
        """Seconds between the samples around wall-clock ``t``: traffic within that span of ``t`` may be
        counted on the wrong side of it (0 where a sample falls on ``t``)."""
        i = bisect.bisect_left(self.times, t)
        if i == 0 or i == len(self.times) or self.times[i] == t:
            return 0.0
        return self.times[i] - self.times[i - 1]

    def wait_past(self, t: float) -> None:
        """Return once a sample later than wall-clock ``t`` was taken (so that :meth:`at` can read ``t``)."""
        while not self.times or self.times[-1] < t:
            if not self._thread.is_alive():
                raise RuntimeError("the counter sampler is not running")
            time.sleep(self.period)

    def between(self, start: float, end: float) -> dict[str, tuple[float, float]]:
        """(rx, tx) bytes of every source between ``start`` and ``end``."""
        a, b = self.at(start), self.at(end)
        return {k: (b[k][0] - a[k][0], b[k][1] - a[k][1]) for k in a}


@dataclass(frozen=True)
class Link:
    """The link of a row: ``rate_mbit`` None is the loopback (one host); ``delay_ms``: each worker host's
    link delayed that much each way (``tests/lab/netlab.py``: netem, or its delay line without netem)."""

    rate_mbit: float | None
    delay_ms: float = 0.0

    @property
    def name(self) -> str:
        if self.rate_mbit is None:
            return "loopback"
        rate = f"{self.rate_mbit / 1000:g}gbit" if self.rate_mbit >= 1000 else f"{self.rate_mbit:g}mbit"
        return rate + (f"+{self.delay_ms:g}ms" if self.delay_ms else "")

    @classmethod
    def parse(cls, text: str) -> Link:
        """``loopback``, ``<n>mbit`` or ``<n>gbit``, optionally ``+<d>ms`` (a worker link's delay)."""
        t = text.strip().lower()
        if t == "loopback":
            return cls(None)
        match = re.fullmatch(r"([0-9.]+)(mbit|gbit)(?:\+([0-9.]+)ms)?", t)
        try:
            rate, unit, delay = match.groups()
            return cls(float(rate) * (1000.0 if unit == "gbit" else 1.0), float(delay or 0.0))
        except (AttributeError, ValueError):  # no match, or a number such as "1.2.3"
            expected = "expected loopback, <n>mbit or <n>gbit, optionally +<d>ms"
            raise ValueError(f"link {text!r}: {expected}") from None


class LabSite:
    """Rows on the lab's hosts (module docstring). ``data`` is the lab's shared folder on this machine;
    the hosts see it as ``/data``."""

    def __init__(self, lab: Lab, workers: int, shape_head: bool, keep_dir: Path | None = None):
        self.lab = lab
        self.workers = lab.workers[:workers]
        self.shape_head = shape_head
        self.link = Link(None)
        self.local_root = lab.data / "bw"
        self.site_root = "/data/bw"
        self.keep_dir = keep_dir or ROOT / "runs" / "bandwidth" / "lab-logs"
        self.local_root.mkdir(parents=True, exist_ok=True)
        # Ray's token authentication, as docs/cluster.md sets it up: one token every host reads (the
        # hosts' home folders are their own, so a token Ray generates on one host is unknown to the others)
        token = self.local_root / "ray-auth-token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        # and the settings every node of a dpgs cluster starts Ray with (configs/cluster.yaml)
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": f"{self.site_root}/ray-auth-token",
                    "REPORTER_UPDATE_INTERVAL_MS": str(NODE_STATS_INTERVAL_MS), **RAY_NODE_ENV}

    # ---------------------------------------------------------------- Ray
    def start_ray(self, log) -> None:
        head = self.lab.hosts["head"].address
        common = f"--object-store-memory={OBJECT_STORE_BYTES} --disable-usage-stats"
        self._sh("head", f"ray start --head --node-ip-address={head} --port={RAY_PORT} --num-cpus=0 "
                 f"--include-dashboard=false {common}")
        for w in self.workers:
            address = self.lab.hosts[w].address
            self._sh(w, f"ray start --address={head}:{RAY_PORT} --node-ip-address={address} "
                     f"--num-cpus=1 {common}")
        deadline = time.monotonic() + 300
        check = ("import ray; ray.init(address='auto', log_to_driver=False); "
                 "print(sum(1 for n in ray.nodes() if n['Alive']))")
        while time.monotonic() < deadline:
            out = self.lab.run("head", ["python", "-c", check], check=False, timeout=120, env=self.env)
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(1 + len(self.workers))]:
                log(f"[lab] Ray: head and {len(self.workers)} worker nodes alive")
                return
            time.sleep(3)
        raise LabError(f"Ray nodes did not all join within 300 s: {out.stdout[-500:]} {out.stderr[-1500:]}")

    def ray_alive(self) -> bool:
        """Whether the head and every worker node are alive in Ray (one ``ray.init`` on the head)."""
        check = ("import ray; ray.init(address='auto', log_to_driver=False); "
                 "print(sum(1 for n in ray.nodes() if n['Alive']))")
        out = self.lab.run("head", ["python", "-c", check], check=False, timeout=120, env=self.env)
        return out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(1 + len(self.workers))]

    def after_failure(self, row_id: str, log) -> None:
        """After a failed row: keep the tails of the hosts' Ray logs (``keep_dir``: the lab's own folders
        go with it), and start Ray again when a node of it is gone, so that the next rows can run."""
        self.keep_dir.mkdir(parents=True, exist_ok=True)
        with (self.keep_dir / f"{row_id}.ray-logs.txt").open("w") as out:
            for host in ["head", *self.workers]:
                logs = self.lab.path_on(host, "/tmp/ray/session_latest/logs")
                for name in ("gcs_server.out", "gcs_server.err", "raylet.out", "raylet.err", "monitor.log"):
                    f = logs / name
                    if f.is_file():
                        lines = f.read_text(errors="replace").splitlines()[-80:]
                        out.write(f"===== {host}: {name} (last {len(lines)} lines)\n")
                        out.write("\n".join(lines) + "\n")
        if self.ray_alive():
            return
        log(f"[lab] Ray lost a node during {row_id} (its logs: {self.keep_dir / f'{row_id}.ray-logs.txt'}); "
            "starting it again")
        self.stop_ray()
        self.start_ray(log)

    def stop_ray(self) -> None:
        for host in ["head", *self.workers]:
            self.lab.run(host, "ray stop --force >/dev/null 2>&1", check=False, timeout=120, env=self.env)

    def _sh(self, host: str, command: str) -> None:
        # output to a file of the host: the daemons Ray starts must not hold a pipe of ours open
        result = self.lab.run(host, f"ulimit -n 65536; {command} >/tmp/ray-start.log 2>&1", check=False,
                              timeout=300, env=self.env)
        if result.returncode != 0:
            log = self.lab.path_on(host, "/tmp/ray-start.log")
            raise LabError(f"on {host}: {command} failed: {log.read_text()[-3000:] if log.exists() else ''}")

    def idle_bytes_per_second(self, sampler: CounterSampler, seconds: float = IDLE_WINDOW_S) -> float:
        """Wire bytes per second (:meth:`wire`) of the running cluster with no job on it, over ``seconds``
        (waited here)."""
        start = time.time()
        time.sleep(seconds)
        end = time.time()
        sampler.wait_past(end)
        return self.wire(sampler.between(start, end)) / (end - start)

    # ---------------------------------------------------------------- links
    def shape(self, link: Link) -> None:
        hosts = (["head"] if self.shape_head else []) + self.workers
        for host in ["head", *self.workers]:
            self.lab.link(host, rate_mbit=link.rate_mbit if host in hosts else None,
                          delay_ms=link.delay_ms if host in self.workers else 0.0)
        self.link = link

    @property
    def shaped(self) -> str:
        if self.link.rate_mbit is None:
            return "unshaped"
        where = "every host's link (head and workers)" if self.shape_head else "the worker hosts' links"
        return where + (f", each worker link delayed {self.link.delay_ms:g} ms each way" if self.link.delay_ms
                        else "")

    # ---------------------------------------------------------------- processes
    def sampler(self) -> CounterSampler:
        return CounterSampler({h: (self.lab.hosts[h].pid, "eth0") for h in ["head", *self.workers]})

    def wire(self, counts: dict[str, tuple[float, float]]) -> float:
        """A window's wire bytes: rx + tx of the worker hosts' interfaces (a byte between the head and a
        worker counts once, a byte between two workers, as DDP's, at both ends)."""
        return sum(rx + tx for host, (rx, tx) in counts.items() if host in self.workers)

    def dpgs_overrides(self) -> list[str]:
        return ["dpgs.address=auto"]

    def start_driver(self, argv: list[str]) -> subprocess.Popen:
        env = [f"{k}={v}" for k, v in self.env.items()]
        return self.lab.popen("head", ["env", *env, *argv], cwd=str(ROOT))

    def start_ddp_rank(self, rank: int, argv: list[str]) -> subprocess.Popen:
        return self.lab.popen(self.workers[rank], ["env", "GLOO_SOCKET_IFNAME=eth0", *argv], cwd=str(ROOT))

    def ddp_master(self) -> str:
        return self.lab.hosts[self.workers[0]].address

    def worker_addresses(self) -> list[str]:
        return [self.lab.hosts[w].address for w in self.workers]


class LoopbackSite:
    """Rows on this machine only, inside the private network namespace this process runs in."""

    def __init__(self, local_root: Path, workers: int):
        self.workers = [f"rank{r}" for r in range(workers)]
        self.link = Link(None)
        self.shaped = "none (one host, loopback)"
        self.local_root = local_root
        self.site_root = str(local_root)
        local_root.mkdir(parents=True, exist_ok=True)

    def sampler(self) -> CounterSampler:
        return CounterSampler({"lo": (os.getpid(), "lo")})

    def wire(self, counts: dict[str, tuple[float, float]]) -> float:
        """A window's wire bytes: what was sent over the loopback (each byte once)."""
        return counts["lo"][1]

    def idle_bytes_per_second(self, sampler: CounterSampler) -> None:
        """None: no cluster runs between loopback rows (each row starts its own Ray), so nothing is idle."""
        return None

    def dpgs_overrides(self) -> list[str]:
        return []

    def start_driver(self, argv: list[str]) -> subprocess.Popen:
        """The row's driver; the Ray it starts publishes node stats as the lab's does (every
        ``NODE_STATS_INTERVAL_MS``), so its loopback carries the same kinds of traffic."""
        return subprocess.Popen(argv, cwd=ROOT, text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, bufsize=1,
                                env={**os.environ,
                                     "REPORTER_UPDATE_INTERVAL_MS": str(NODE_STATS_INTERVAL_MS)})

    def start_ddp_rank(self, rank: int, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, cwd=ROOT, text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, bufsize=1,
                                env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})

    def ddp_master(self) -> str:
        return "127.0.0.1"

    def worker_addresses(self) -> list[str]:
        return ["127.0.0.1"] * len(self.workers)
