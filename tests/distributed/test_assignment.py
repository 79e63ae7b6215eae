from dpgs.distributed.assignment import assign_lpt, imbalance


def test_every_bag_assigned_once_and_balanced():
    lengths = [1000, 3, 500, 499, 7, 1, 250, 250]
    plan = assign_lpt(lengths, 3)
    flat = sorted(p for part in plan for p in part)
    assert flat == list(range(len(lengths)))
    loads = [sum(lengths[p] for p in part) for part in plan]
    assert max(loads) == 1000  # the longest bag alone is the optimum makespan here


def test_more_workers_than_bags_leaves_idle_workers():
    plan = assign_lpt([5, 6], 4)
    assert sorted(len(p) for p in plan) == [0, 0, 1, 1]


def test_imbalance():
    assert imbalance([1.0, 1.0]) == 0.0
    assert imbalance([3.0, 1.0]) == 0.5
    assert imbalance([0.0, 2.0]) == 0.0
