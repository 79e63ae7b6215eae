"""A network of hosts on this machine: Linux namespaces joined by a bridge, for `ray up` and fault tests.

Every host is a machine of its own as far as Ray, ssh and dpgs can tell:

* its **network namespace** (``<name>-<host>``) with one interface ``eth0`` and its own address in
  ``10.213.0.0/24``, plugged into a bridge that lives in a namespace of its own (``<name>-switch``): no
  interface, route or address of the lab exists in this machine's namespace, so no lab traffic leaves the
  lab and nothing outside can reach it;
* its **PID, mount and UTS namespaces** (``unshare --pid --fork --mount-proc --mount --uts``): ``ray
  stop`` on one host stops only that host's Ray; its host name (``<name>-<host>``) resolves nowhere,
  as on machines whose name is not in DNS;
* its **root file system**: an overlay of this machine's ``/`` with a private upper layer in memory, so a
  host sees the installed software (Python, the checkout and its ``.venv``) but everything it writes
  (``/opt/dpgs-src``, ``~/ray_bootstrap_config.yaml``, an install into the venv) stays its own, and a
  private ``/tmp`` (``/tmp/ray`` included), ``/run`` and ``/dev/shm`` (a checkout or venv under test inside
  one of those, such as a fresh clone in ``/tmp``, is overlaid at its own path, private as the rest);
* its **sshd** (PID 1 of the host) on port 22, root login with the lab's key, and ``ray``/``dpgs`` of
  the venv under test on the PATH of every shell, non-interactive ones included (its own ``~/.bashrc``,
  as a fresh node has: none of this machine's shell setup);
* the **data folder** ``/data``: one directory of this machine, mounted on every host (a shared file
  system).

Each host link is shaped with ``tc`` on both of its ends (:meth:`Lab.link`: rate, delay, loss) and can be
cut (:meth:`Lab.cut`). Where the kernel has no netem qdisc (built without ``CONFIG_NET_SCH_NETEM``), rate
is shaped with tbf, loss is dropped by netfilter, and delay is added by a user-space delay line behind
netfilter queues (``tests/lab/delay.py``; it needs a C compiler).

Tear-down (:meth:`Lab.down`, also ``python -m tests.lab.netlab down``) kills every process of the lab's
network namespaces by id (a host's PID 1 takes its whole PID namespace with it, so its Ray goes too) and
deletes the namespaces; mounts live only in the hosts' mount namespaces and vanish with them. A lab held
by a process (``Lab.up(tied=True)``, the default) dies with that process even when it is SIGKILLed.

Hosts: ``client`` (10.213.0.2, where `ray up` runs: a user's machine), ``head`` (10.213.0.10) and
``worker1`` .. ``workerN`` (10.213.0.11 ...). Needs root; installs iproute2, openssh and rsync with
apt-get when they are missing.

API::

    lab = Lab.up(workers=2)            # or: with Lab.up() as lab: ...
    lab.run("head", ["ray", "status"]) # a command on a host (its namespaces, its root, the lab's PATH)
    lab.ssh("head", "ray status")      # the same through ssh from the client, as a user would
    lab.link("worker1", rate_mbit=10, delay_ms=5, loss_pct=1)
    lab.cut("worker1"); lab.heal("worker1")
    lab.counters("worker1")            # {"rx_bytes": ..., "tx_bytes": ...} of the host's eth0
    lab.down()

CLI: ``python -m tests.lab.netlab up|down|status|link|cut|heal|counters|run`` (``--help``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.lab import delay

NAME = "dpgslab"
SUBNET = "10.213.0"
PREFIX_LEN = 24
STATE_ROOT = Path("/var/tmp")
DATA_MOUNT = "/data"
SSH_PORT = 22
WHEELHOUSE = Path.home() / ".cache" / "dpgs-lab" / "wheels"
ROOT = Path(__file__).resolve().parents[2]
# tools the lab runs, and the Debian package of each
TOOLS = {
    "ip": "iproute2",
    "tc": "iproute2",
    "sshd": "openssh-server",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "rsync": "rsync",
    "iptables": "iptables",
    "unshare": "util-linux",
    "nsenter": "util-linux",
}
SBIN = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class LabError(RuntimeError):
    """The lab cannot run here (the message says why) or a lab operation failed."""


@dataclass(frozen=True)
class Host:
    name: str  # client, head, worker1, ...
    address: str
    netns: str
    pid: int  # the host's PID 1, as seen from this machine


@dataclass(frozen=True)
class Link:
    """How a host's link is shaped, in each direction. ``None``/0: not limited."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    loss_pct: float = 0.0


def host_names(workers: int) -> list[str]:
    return ["client", "head", *[f"worker{i}" for i in range(1, workers + 1)]]


def host_address(host: str) -> str:
    if host == "client":
        return f"{SUBNET}.2"
    if host == "head":
        return f"{SUBNET}.10"
    return f"{SUBNET}.{10 + int(host.removeprefix('worker'))}"


def sh(*argv: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and result.returncode != 0:
        raise LabError(f"{shlex.join(argv)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return result


# ------------------------------------------------------------------ checks
def missing_tools() -> list[str]:
    return sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool, path=SBIN) is None})


def ensure_tools() -> None:
    """Install the Debian packages of missing tools (apt-get), or refuse naming them."""
    missing = missing_tools()
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise LabError(f"the lab needs {', '.join(missing)} (no apt-get here to install them)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"[lab] installing {' '.join(missing)} (apt-get)", flush=True)
    sh("apt-get", "update", "-q", timeout=600, env=env)
    sh("apt-get", "install", "-y", "-q", "--no-install-recommends", *missing, timeout=900, env=env)
    if missing_tools():
        raise LabError(f"apt-get did not provide {', '.join(missing_tools())}")


def check_can_run() -> None:
    """Raise LabError naming what is missing: root, network/PID/mount namespaces, overlayfs."""
    if sys.platform != "linux":
        raise LabError(f"the lab needs Linux namespaces (this is {sys.platform})")
    if os.geteuid() != 0:
        raise LabError("the lab needs root (it creates network namespaces, mounts and runs sshd)")
    for ns in ("net", "pid", "mnt", "uts"):
        if not Path(f"/proc/self/ns/{ns}").exists():
            raise LabError(f"this kernel has no {ns} namespaces")
    if "overlay" not in Path("/proc/filesystems").read_text():
        raise LabError("this kernel has no overlay file system (the hosts' root file systems)")
    probe = f"{NAME}-probe-{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        raise LabError(f"cannot create a network namespace here: {result.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _kernel_has_netem(netns: str, dev: str) -> bool:
    ok = subprocess.run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"],
                        capture_output=True).returncode == 0
    subprocess.run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
    return ok


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the process that started it dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def wheelhouse(python: str) -> Path:
    """A folder of the wheels `pip install .` needs to build dpgs offline (setuptools, wheel); the hosts
    have no index, as on an air-gapped site. Downloaded once from the package index, then cached."""
    needed = ("setuptools", "wheel")
    if all(any(WHEELHOUSE.glob(f"{name}-*.whl")) for name in needed):
        return WHEELHOUSE
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    sh(python, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(WHEELHOUSE),
       "setuptools>=68", "wheel", timeout=600)
    return WHEELHOUSE


# ------------------------------------------------------------------ the lab
HOST_INIT = r"""
set -e
L={layer}; M={merged}
mount -t tmpfs -o mode=755 {tag} "$L"
mkdir -p "$L/upper" "$L/work"
mount -t overlay {tag} -o "lowerdir=/,upperdir=$L/upper,workdir=$L/work" "$M"
mount -t proc proc "$M/proc"
mount --rbind /sys "$M/sys"
mount --rbind /dev "$M/dev"
mount -t tmpfs -o size=8g,mode=1777 shm "$M/dev/shm"
mount -t tmpfs -o mode=1777 tmp "$M/tmp"
mount -t tmpfs -o mode=755 run "$M/run"
mkdir -p "$M/run/sshd" "$M{data_mount}" "$M/etc/dpgslab"
mount --bind {data} "$M{data_mount}"
{shown}{docker_root}cp -a {etc}/. "$M/etc/dpgslab/"
cp {bashrc} "$M/root/.bashrc"
printf '. ~/.bashrc\n' > "$M/root/.profile"
hostname {hostname}
{enter_root} /usr/sbin/sshd -D -e -f /etc/dpgslab/sshd_config
"""
# How PID 1 (sshd) enters the host's root. A chroot is enough for ssh, Ray and dpgs; dockerd needs the
# root to be its mount namespace's own (runc's `exec` lands in that root: under a chroot, `docker exec`
# ran in this machine's /), so docker hosts pivot into it.
CHROOT = 'exec chroot "$M"'
PIVOT_ROOT = 'cd "$M" && mkdir -p .old-root && pivot_root . .old-root && umount -l /.old-root && cd / && exec'


# folders a host replaces with its own: a checkout or venv there would be hidden from the hosts
PRIVATE_FOLDERS = ("/tmp", "/run", "/dev/shm")


def shown_folders_script(folders: list[Path]) -> str:
    """Shell lines that show ``folders`` (the checkout, the venv under test) at their own path on a host,
    for those inside a folder the host replaces (a fresh clone in /tmp: its client host saw no checkout
    and no ``dpgs``): an overlay of each, so that what a host writes there (``pip install .`` into the
    venv) stays its own, as everywhere else in its root."""
    hidden = sorted({f for f in folders if any(f.is_relative_to(p) for p in PRIVATE_FOLDERS)})
    hidden = [f for f in hidden if not any(f != g and f.is_relative_to(g) for g in hidden)]  # outermost
    lines = []
    for i, folder in enumerate(hidden):
        path, layer = shlex.quote(str(folder)), f'"$L/shown{i}"'
        options = f'"lowerdir="{path}",upperdir=$L/shown{i}/upper,workdir=$L/shown{i}/work"'
        lines.append(f'mkdir -p {layer}/upper {layer}/work "$M"{path} && '
                     f'mount -t overlay shown{i} -o {options} "$M"{path}\n')
    return "".join(lines)


DOCKER_ROOT_INIT = r"""mkdir -p {root} "$M/var/lib/docker"
mount --bind {root} "$M/var/lib/docker"
mount -t tmpfs -o mode=755 cgroup "$M/sys/fs/cgroup"
{cgroups}"""


def cgroup_mounts_script(mountinfo: str) -> str:
    """Shell lines that mount this machine's cgroup hierarchies (``mountinfo``: its
    ``/proc/self/mountinfo``) under ``$M/sys/fs/cgroup``: dockerd needs them, and ``ip netns exec`` gives
    a host a fresh ``/sys`` without them."""
    lines = []
    for entry in mountinfo.splitlines():
        left, _, right = entry.partition(" - ")
        fields, (fstype, _source, options) = left.split(), right.split()[:3]
        if fstype not in ("cgroup", "cgroup2") or not fields[4].startswith("/sys/fs/cgroup/"):
            continue
        if not re.fullmatch(r"[\w/.,=+-]+", fields[4] + options):
            raise LabError(f"unexpected cgroup mount on this machine: {entry}")
        target = f'"$M{fields[4]}"'
        wanted = ",".join(o for o in options.split(",") if o not in ("rw", "ro"))
        mount = f"mount -t {fstype} -o {wanted}" if wanted else f"mount -t {fstype}"
        lines.append(f"mkdir -p {target} && {mount} {fstype} {target}")
    return "\n".join(lines) + "\n"

SSHD_CONFIG = """ListenAddress {address}:{port}
HostKey /etc/dpgslab/ssh_host_ed25519_key
AuthorizedKeysFile /etc/dpgslab/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile none
UseDNS no
MaxSessions 100
MaxStartups 100
Subsystem sftp internal-sftp
"""


class Lab:
    """A running lab (see the module docstring). Create with :meth:`up`, find again with :meth:`attach`."""

    def __init__(self, name: str, state: Path, hosts: dict[str, Host], venv: Path, netem: bool):
        self.name, self.state, self.hosts, self.venv, self.netem = name, state, hosts, venv, netem
        self.key = state / "id_ed25519"
        self.data = state / "data"
        self.links: dict[str, Link] = {}  # shaped by :meth:`link` (:meth:`link_of`)

    # ---------------------------------------------------------------- bring up
    @classmethod
    def up(cls, workers: int = 2, name: str = NAME, venv: Path | None = None, tied: bool = True,
           docker: bool = False) -> Lab:
        """Bring up ``client``, ``head`` and ``workers`` worker hosts (after removing any earlier lab of
        this name). ``venv``: whose ``bin`` is first on the hosts' PATH (default: this Python's).
        ``tied``: the hosts die with this process. ``docker``: the head and the workers get a Docker data
        root on this machine's disk (``/var/lib/docker``; overlay2 cannot sit on their in-memory overlay
        root), for :meth:`start_dockerd`."""
        check_can_run()
        ensure_tools()
        if workers < 1:
            raise LabError("the lab needs at least one worker host")
        venv = Path(venv or sys.prefix)
        sweep(name)
        state = STATE_ROOT / name
        (state / "data").mkdir(parents=True)
        state.chmod(0o700)
        switch = f"{name}-switch"
        hosts: dict[str, Host] = {}
        lab = cls(name, state, hosts, venv, netem=False)
        try:
            sh("ip", "netns", "add", switch)
            sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", switch, "link", "set", "br0", "up")
            sh("ip", "-n", switch, "link", "set", "lo", "up")
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{name}-client", "-f", str(lab.key))
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{name}-host",
               "-f", str(state / "ssh_host_ed25519_key"))
            find_links = wheelhouse(str(venv / "bin" / "python"))
            for host in host_names(workers):
                hosts[host] = lab._start_host(host, switch, find_links, tied, docker and host != "client")
            lab.netem = _kernel_has_netem(switch, "p-head")
            lab._save()
            for host in hosts:
                lab._wait_for_sshd(host)
        except BaseException:
            lab.down()
            raise
        return lab

    def _start_host(self, host: str, switch: str, find_links: Path, tied: bool, docker: bool) -> Host:
        netns, address = f"{self.name}-{host}", host_address(host)
        sh("ip", "netns", "add", netns)
        sh("ip", "-n", switch, "link", "add", f"p-{host}", "type", "veth", "peer", "name", "eth0",
           "netns", netns)
        sh("ip", "-n", switch, "link", "set", f"p-{host}", "master", "br0", "up")
        sh("ip", "-n", netns, "link", "set", "lo", "up")
        sh("ip", "-n", netns, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", "eth0")
        sh("ip", "-n", netns, "link", "set", "eth0", "up")
        home = self.state / "hosts" / host
        etc = home / "etc"
        for folder in (home / "layer", home / "root", etc):
            folder.mkdir(parents=True)
        (etc / "sshd_config").write_text(SSHD_CONFIG.format(address=address, port=SSH_PORT))
        shutil.copy(self.state / "ssh_host_ed25519_key", etc / "ssh_host_ed25519_key")
        shutil.copy(self.key.with_suffix(".pub"), etc / "authorized_keys")
        (home / "bashrc").write_text(  # a fresh node's ~/.bashrc, not this machine's (its shell setup)
            "# dpgs lab host: the venv under test first on PATH, pip offline (as on an air-gapped site)\n"
            f"export PATH={self.venv}/bin:{SBIN}\n"
            f"export PIP_NO_INDEX=1 PIP_FIND_LINKS={find_links} PIP_DISABLE_PIP_VERSION_CHECK=1\n"
        )
        script = HOST_INIT.format(
            layer=shlex.quote(str(home / "layer")), merged=shlex.quote(str(home / "root")),
            tag=f"{self.name}-{host}", data=shlex.quote(str(self.data)), data_mount=DATA_MOUNT,
            etc=shlex.quote(str(etc)), bashrc=shlex.quote(str(home / "bashrc")),
            hostname=f"{self.name}-{host}",
            enter_root=PIVOT_ROOT if docker else CHROOT,
            shown=shown_folders_script([ROOT, self.venv.resolve()]),
            docker_root=DOCKER_ROOT_INIT.format(
                root=shlex.quote(str(home / "docker")),
                cgroups=cgroup_mounts_script(Path("/proc/self/mountinfo").read_text()),
            ) if docker else "",
        )
        log = open(home / "init.log", "w")  # noqa: SIM115 (the host's lifetime)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, "unshare", "--pid", "--fork", "--kill-child=SIGKILL",
             "--mount-proc", "--mount", "--uts", "--propagation", "private", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent if tied else None,
        )
        log.close()
        return Host(host, address, netns, self._init_pid(proc, home / "init.log"))

    @staticmethod
    def _init_pid(unshare: subprocess.Popen, log: Path, timeout_s: float = 30) -> int:
        """The global pid of the host's PID 1 (the child ``unshare`` forked)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if unshare.poll() is not None:
                raise LabError(f"a lab host did not start: {log.read_text()[-2000:]}")
            children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
            pids = children.read_text().split() if children.exists() else []
            if pids:
                return int(pids[0])
            time.sleep(0.05)
        raise LabError(f"a lab host did not start within {timeout_s:g}s")

    def _wait_for_sshd(self, host: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ssh(host, "true", check=False, timeout=20).returncode == 0:
                return
            time.sleep(0.3)
        log = self.state / "hosts" / host / "init.log"
        raise LabError(f"sshd of lab host {host} does not answer: {log.read_text()[-2000:]}")

    def _save(self) -> None:
        record = {"venv": str(self.venv), "netem": self.netem,
                  "hosts": {h.name: [h.address, h.netns, h.pid] for h in self.hosts.values()}}
        (self.state / "state.json").write_text(json.dumps(record))

    @classmethod
    def attach(cls, name: str = NAME) -> Lab:
        """The lab of this name that is running now (brought up by another process)."""
        state = STATE_ROOT / name
        try:
            record = json.loads((state / "state.json").read_text())
        except (OSError, ValueError) as err:
            raise LabError(f"no lab named {name} is running ({err})") from None
        hosts = {h: Host(h, a, n, p) for h, (a, n, p) in record["hosts"].items()}
        return cls(name, state, hosts, Path(record["venv"]), record["netem"])

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    # ---------------------------------------------------------------- using hosts
    @property
    def workers(self) -> list[str]:
        return [h for h in self.hosts if h.startswith("worker")]

    def host_env(self) -> dict[str, str]:
        """The environment of a command run on a host with :meth:`run` (what its ~/.bashrc sets)."""
        return {"PATH": f"{self.venv}/bin:{SBIN}", "HOME": "/root", "LANG": "C.UTF-8", "USER": "root",
                "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(WHEELHOUSE), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    def run(self, host: str, argv: list[str] | str, *, check: bool = True, timeout: float = 600,
            env: dict[str, str] | None = None, cwd: str = "/", capture: bool = True,
            ) -> subprocess.CompletedProcess:
        """Run ``argv`` (a string: through ``bash -c``) on ``host``: in its namespaces and root."""
        if isinstance(argv, str):
            argv = ["bash", "-c", argv]
        pid = self.hosts[host].pid
        # the host's root and its PID 1's working directory (its /), then cwd inside that root
        cmd = ["nsenter", "--target", str(pid), "--all", "--root", "--wd",
               "sh", "-c", 'cd "$0" && exec "$@"', cwd, *argv]
        result = subprocess.run(cmd, env={**self.host_env(), **(env or {})}, text=True, timeout=timeout,
                                capture_output=capture, stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise LabError(f"on {host}: {shlex.join(argv)} failed ({result.returncode}): "
                           f"{(result.stderr or '').strip()[-3000:]}")
        return result

    def popen(self, host: str, argv: list[str], cwd: str = "/") -> subprocess.Popen:
        """Start ``argv`` on ``host`` (as :meth:`run`), its stdout and stderr together in a text pipe."""
        pid = self.hosts[host].pid
        cmd = ["nsenter", "--target", str(pid), "--all", "--root", "--wd",
               "sh", "-c", 'cd "$0" && exec "$@"', cwd, *argv]
        return subprocess.Popen(cmd, env=self.host_env(), text=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1)

    def ssh_argv(self, host: str) -> list[str]:
        options = ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR",
                   "BatchMode=yes", "ConnectTimeout=10"]
        return ["ssh", "-i", str(self.key), *[w for o in options for w in ("-o", o)],
                f"root@{self.hosts[host].address}"]

    def ssh(self, host: str, command: str, *, check: bool = True, timeout: float = 600,
            ) -> subprocess.CompletedProcess:
        """``command`` through ssh from the client host (a non-interactive shell, as a user gets)."""
        result = self.run("client", [*self.ssh_argv(host), command], check=False, timeout=timeout)
        if check and result.returncode != 0:
            raise LabError(f"ssh {host} {command!r} failed ({result.returncode}): "
                           f"{result.stderr.strip()[-3000:]}")
        return result

    def path_on(self, host: str, path: str) -> Path:
        """Where this machine sees ``path`` of ``host``'s file system (through its PID 1's root)."""
        return Path(f"/proc/{self.hosts[host].pid}/root") / path.lstrip("/")

    def processes(self, host: str) -> dict[int, str]:
        """Every process of ``host`` but its PID 1: global pid -> command line."""
        init = self.hosts[host].pid
        ns = os.readlink(f"/proc/{init}/ns/pid")
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == init:
                continue
            try:
                if os.readlink(entry / "ns/pid") == ns:
                    cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                    found[int(entry.name)] = cmdline.decode(errors="replace").strip()
            except OSError:
                continue
        return found

    def kill(self, host: str, pids: list[int] | set[int]) -> None:
        """SIGKILL ``pids`` (processes of ``host``, from :meth:`processes`)."""
        own = self.processes(host)
        for pid in pids:
            if pid not in own:
                raise LabError(f"pid {pid} is not a process of lab host {host}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ---------------------------------------------------------------- docker
    def cgroup_parent(self, host: str) -> str:
        """The cgroup under which ``host``'s containers run (removed by :func:`sweep`)."""
        return f"{self.name}-{host}"

    def start_dockerd(self, host: str, timeout_s: float = 120) -> None:
        """Start Debian's ``dockerd`` on ``host`` (a lab made with ``docker=True``): its own data root, its
        socket in the host's private ``/run``, no bridge and no iptables rules (containers use the host's
        network, as ``ray up``'s ``docker run --net=host`` does), containers under :meth:`cgroup_parent`.
        It lives in the host's PID namespace and ends with the host."""
        if not self.run(host, "mountpoint -q /var/lib/docker", check=False).returncode == 0:
            raise LabError(f"lab host {host} has no Docker data root (bring the lab up with docker=True)")
        daemon = ["dockerd", "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-masq=false",
                  "--exec-opt", "native.cgroupdriver=cgroupfs",
                  "--cgroup-parent", f"/{self.cgroup_parent(host)}"]
        self.run(host, f"setsid {shlex.join(daemon)} > /var/log/dockerd.log 2>&1 < /dev/null &")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ping = self.run(host, ["docker", "version", "--format", "{{.Server.Version}}"], check=False)
            if ping.returncode == 0:
                return
            time.sleep(0.5)
        log = self.run(host, "tail -n 20 /var/log/dockerd.log", check=False).stdout
        raise LabError(f"dockerd on lab host {host} did not answer within {timeout_s:g}s:\n{log}")

    # ---------------------------------------------------------------- links
    def _ends(self, host: str) -> list[tuple[str, str]]:
        """(netns, device) of both ends of ``host``'s link: its egress, and the switch port toward it."""
        return [(self.hosts[host].netns, "eth0"), (f"{self.name}-switch", f"p-{host}")]

    def link_of(self, host: str) -> Link:
        """How ``host``'s link is shaped now (unshaped until :meth:`link` shapes it)."""
        return self.links.get(host, Link())

    def link(self, host: str, rate_mbit: float | None = None, delay_ms: float = 0.0, loss_pct: float = 0.0,
             ) -> None:
        """Shape ``host``'s link, each direction: ``rate_mbit`` (None: unlimited), ``delay_ms`` one way,
        ``loss_pct`` of packets dropped. All zero/None: unshaped."""
        if rate_mbit is not None and rate_mbit <= 0 or delay_ms < 0 or not 0 <= loss_pct <= 100:
            raise LabError(f"bad link {rate_mbit=} {delay_ms=} {loss_pct=}")
        for netns, dev in self._ends(host):
            subprocess.run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if self.netem and (rate_mbit or delay_ms or loss_pct):
                args = ["netem", "limit", "100000"]
                args += ["delay", f"{delay_ms}ms"] if delay_ms else []
                args += ["loss", f"{loss_pct}%"] if loss_pct else []
                args += ["rate", f"{rate_mbit}mbit"] if rate_mbit else []
                sh("tc", "-n", netns, "qdisc", "add", "dev", dev, "root", *args)
            elif rate_mbit:
                burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 / 100))  # 10 ms of traffic, at least 64 KiB
                sh("tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                   "burst", str(burst), "latency", "2s")
        delay_changed = self.link_of(host).delay_ms != delay_ms
        self.links[host] = Link(rate_mbit, delay_ms, loss_pct)
        if not self.netem:  # a host's delay is waited where its packets arrive: every host's rules change
            for other in (self.hosts if delay_changed else [host]):
                self._netfilter(other)

    def _delay_queues(self, host: str) -> list[delay.Queue]:
        """What ``host`` delays on receipt: from each other host, the two links' delays (one queue each)."""
        own = self.link_of(host).delay_ms
        return [delay.Queue(number, h.address, self.link_of(name).delay_ms + own)
                for number, (name, h) in enumerate(self.hosts.items())
                if name != host and self.link_of(name).delay_ms + own > 0]

    def _netfilter(self, host: str) -> None:
        """``host``'s loss (dropped both ways) and delay (:mod:`tests.lab.delay`) without netem."""
        netns = self.hosts[host].netns
        iptables = ["ip", "netns", "exec", netns, "iptables", "-w"]
        loss_pct = self.link_of(host).loss_pct
        for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
            sh(*iptables, "-F", chain)
            if loss_pct:
                sh(*iptables, "-A", chain, flag, "eth0", "-m", "statistic", "--mode", "random",
                   "--probability", f"{loss_pct / 100:.6f}", "-j", "DROP")
        queues = self._delay_queues(host)
        pid_file = self.state / "hosts" / host / "delayline.pid"
        if not queues:
            delay.stop(pid_file)
            return
        try:
            delay.start(delay.build(self.state), netns, queues, pid_file)
        except delay.DelayError as err:
            raise LabError(str(err)) from None
        for rule in delay.rules("eth0", queues):
            sh(*iptables, *rule)

    def cut(self, host: str) -> None:
        """Cut ``host``'s link (its switch port goes down: nothing passes either way)."""
        sh("ip", "-n", f"{self.name}-switch", "link", "set", f"p-{host}", "down")

    def heal(self, host: str) -> None:
        sh("ip", "-n", f"{self.name}-switch", "link", "set", f"p-{host}", "up")

    def counters(self, host: str) -> dict[str, int]:
        """Bytes and packets through ``host``'s ``eth0`` since the lab started."""
        out = sh("ip", "-n", self.hosts[host].netns, "-s", "-j", "link", "show", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return {"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"],
                "rx_packets": stats["rx"]["packets"], "tx_packets": stats["tx"]["packets"]}

    # ---------------------------------------------------------------- tear down
    def down(self) -> None:
        """Remove everything of this lab (see :func:`sweep`)."""
        sweep(self.name)


def lab_namespaces(name: str = NAME) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{name}-")]


def sweep(name: str = NAME, timeout_s: float = 30) -> None:
    """Remove every trace of labs called ``name``: kill each process in their network namespaces (by pid:
    a host's PID 1 ends its PID namespace, its mounts go with its mount namespace), delete the
    namespaces (their interfaces go with them) and the state folder. Safe to call any time."""
    namespaces = lab_namespaces(name)
    deadline = time.monotonic() + timeout_s
    for netns in namespaces:
        while True:
            listed = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
            pids = listed.stdout.split()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise LabError(f"processes {pids} of {netns} do not end")
            time.sleep(0.1)
        sh("ip", "netns", "del", netns)
    for folder in lab_cgroups(name):  # the containers' cgroups (empty once their processes are gone)
        for child in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if child.is_dir():
                child.rmdir()
        folder.rmdir()
    shutil.rmtree(STATE_ROOT / name, ignore_errors=True)
    left = leftovers(name)
    if left:
        raise LabError(f"the lab left {left}")


def lab_cgroups(name: str = NAME) -> list[Path]:
    """The cgroup folders of the lab's containers (``Lab.cgroup_parent``), in every hierarchy."""
    root = Path("/sys/fs/cgroup")
    return sorted(root.glob(f"*/{name}-*")) + sorted(root.glob(f"{name}-*"))


def leftovers(name: str = NAME) -> list[str]:
    """What of a lab called ``name`` exists on this machine (empty after :func:`sweep`)."""
    found = [f"network namespace {n}" for n in lab_namespaces(name)]
    found += [f"cgroup {folder}" for folder in lab_cgroups(name)]
    state = STATE_ROOT / name
    if state.exists():
        found.append(f"state folder {state}")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if str(state) in line or f"/run/netns/{name}-" in line:
            found.append(f"mount {line.split()[4]}")
    return found


# ------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.lab.netlab", description=__doc__.split("\n")[0])
    parser.add_argument("--name", default=NAME, help="namespace and state prefix (default %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="bring up client, head and N worker hosts (they stay until `down`)")
    up.add_argument("--workers", type=int, default=2)
    up.add_argument("--venv", help="venv first on the hosts' PATH (default: this Python's)")
    sub.add_parser("down", help="remove the lab: processes, namespaces, interfaces, mounts, state")
    sub.add_parser("status", help="hosts, addresses, link shaping and what is left of a lab")
    link = sub.add_parser("link", help="shape a host's link (both directions)")
    link.add_argument("host")
    link.add_argument("--rate-mbit", type=float)
    link.add_argument("--delay-ms", type=float, default=0.0)
    link.add_argument("--loss-pct", type=float, default=0.0)
    for verb in ("cut", "heal", "counters"):
        sub.add_parser(verb, help=f"{verb} a host's link").add_argument("host")
    run = sub.add_parser("run", help="run a command on a host (its namespaces and root file system)")
    run.add_argument("host")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            lab = Lab.up(args.workers, args.name, Path(args.venv) if args.venv else None, tied=False)
            for host in lab.hosts.values():
                print(f"{host.name:10s} {host.address:15s} netns {host.netns}  pid {host.pid}")
            print(f"ssh key: {lab.key}   data folder: {lab.data} (mounted at {DATA_MOUNT} on every host)")
        elif args.command == "down":
            sweep(args.name)
            print(f"lab {args.name}: nothing left")
        elif args.command == "status":
            left = leftovers(args.name)
            try:
                lab = Lab.attach(args.name)
                for host in lab.hosts.values():
                    print(f"{host.name:10s} {host.address:15s} {lab.counters(host.name)}")
            except LabError as err:
                print(err)
            print("left on this machine:", left or "nothing")
        elif args.command == "link":
            Lab.attach(args.name).link(args.host, args.rate_mbit, args.delay_ms, args.loss_pct)
        elif args.command in ("cut", "heal"):
            getattr(Lab.attach(args.name), args.command)(args.host)
        elif args.command == "counters":
            print(json.dumps(Lab.attach(args.name).counters(args.host)))
        elif args.command == "run":
            argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            return Lab.attach(args.name).run(args.host, argv, check=False, capture=False).returncode
    except LabError as err:
        print(f"lab: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
