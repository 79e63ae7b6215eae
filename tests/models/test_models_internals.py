"""Head internals against dense references: Nystrom attention, CLAM instance loss, smooth SVM,
DSMIL streams, DTFD pseudo-bags, ACMIL STKIM, RRT regions."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dpgs.models import build_head
from dpgs.models.attention import NystromAttention, iterative_pinv
from dpgs.models.clam import smooth_top1_svm
from dpgs.models.dtfd import pseudo_bag_ids
from dpgs.models.rrtmil import region_merge, region_partition


def exact_attention(att: NystromAttention, x):
    q, k, v = att._qkv(x)
    return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


def test_iterative_pinv_matches_linalg_pinv():
    g = torch.Generator().manual_seed(0)
    a = torch.softmax(torch.randn(3, 6, 6, generator=g, dtype=torch.float64), -1)
    torch.testing.assert_close(iterative_pinv(a, 30), torch.linalg.pinv(a), rtol=1e-8, atol=1e-8)


def test_nystrom_is_exact_when_landmarks_are_the_tokens():
    torch.manual_seed(0)
    att = NystromAttention(16, heads=2, landmarks=4, pinv_iterations=40, dropout=0.0).double()
    distinct = torch.randn(1, 4, 16, dtype=torch.float64)
    x = distinct.repeat_interleave(2, dim=1)  # 8 tokens in identical pairs: landmark groups = pairs
    q, k, v = att._qkv(x)
    torch.testing.assert_close(att._attend(q, q, k, v), exact_attention(att, x), rtol=1e-8, atol=1e-10)
    small = torch.randn(2, 3, 16, dtype=torch.float64)  # n <= landmarks: exact softmax attention
    q, k, v = att._qkv(small)
    torch.testing.assert_close(att._attend(q, q, k, v), exact_attention(att, small))
    row = att.attention_row(small, 0)
    torch.testing.assert_close(row.sum(-1), torch.ones(2, dtype=torch.float64))


def test_nystrom_landmark_groups_cover_an_uneven_sequence():
    att = NystromAttention(8, heads=1, landmarks=3, dropout=0.0).double()
    t = torch.arange(7, dtype=torch.float64).view(1, 1, 7, 1)
    # l = ceil(7/3) = 3, groups = 3, front padding 2: groups {0}, {1,2,3}, {4,5,6}
    assert att._landmarks(t).flatten().tolist() == [0.0, 2.0, 5.0]


def test_transmil_handles_bags_larger_than_the_landmarks():
    model = build_head("transmil", 6, 2, hidden=16, heads=2, landmarks=4, dropout=0.0).double().eval()
    x = torch.randn(30, 6, dtype=torch.float64)
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()
        assert model.instance_scores(x).shape == (30,)


def test_smooth_svm_formula():
    s = torch.tensor([[1.0, -0.5], [0.2, 0.3]], dtype=torch.float64)
    y = torch.tensor([0, 0])
    ref = [torch.log(torch.exp(s[i, 0]) + torch.exp(s[i, 1] + 1.0)) - s[i, 0] for i in range(2)]
    torch.testing.assert_close(smooth_top1_svm(s, y), torch.stack(ref))


@pytest.mark.parametrize("loss_name", ["svm", "ce"])
@pytest.mark.parametrize("n", [40, 5])
def test_clam_instance_loss_matches_dense_reference(loss_name, n):
    torch.manual_seed(0)
    model = build_head("clam_sb", 6, 3, hidden=16, attn_dim=8, dropout=0.0, instance_loss=loss_name).double()
    x, y = torch.randn(n, 6, dtype=torch.float64), 2
    out = model.train().loss(x, y)
    h = model.embed(x)
    a = model.attention(h)[:, 0]
    k = min(8, n // 2)  # a 5-instance bag uses k = 2
    feats = torch.cat([h[torch.topk(a, k).indices], h[torch.topk(-a, k).indices]])
    target = torch.cat([torch.ones(k), torch.zeros(k)]).long()
    logits = model.instance_classifiers[y](feats)
    inst = (
        smooth_top1_svm(logits, target)
        if loss_name == "svm"
        else F.cross_entropy(logits, target, reduction="none")
    ).mean()
    ce = F.cross_entropy(model.classifier(torch.softmax(a, 0) @ h)[None], torch.tensor([y]))
    torch.testing.assert_close(out["instance"], 0.3 * inst)
    torch.testing.assert_close(out["ce"], 0.7 * ce)
    assert set(model.eval().loss(x, y)) == {"loss", "per_bag", "logits", "ce"}


def test_clam_single_instance_bag_has_zero_instance_loss():
    model = build_head("clam_mb", 6, 2, dropout=0.0).double().train()
    assert float(model.loss(torch.randn(1, 6, dtype=torch.float64), 1)["instance"].detach()) == 0.0


def test_dsmil_streams_match_dense_reference():
    torch.manual_seed(0)
    model = build_head("dsmil", 5, 2).double().eval()
    x = torch.randn(9, 5, dtype=torch.float64)
    s = model.instance(x)
    crit = s.argmax(0)
    q = model.q(x)
    att = torch.softmax(q @ q[crit].T / q.shape[1] ** 0.5, 0)  # [N, C]
    bag = model.fcc((att.T @ x)[None])[0, :, 0]
    torch.testing.assert_close(model(x), (bag + s.amax(0)) / 2)
    out = model.loss(x, 1)
    expected = 0.5 * F.cross_entropy(bag[None], torch.tensor([1])) + 0.5 * F.cross_entropy(
        s.amax(0)[None], torch.tensor([1])
    )
    torch.testing.assert_close(out["loss"], expected)


@pytest.mark.parametrize("n, groups", [(10, 4), (3, 3), (8, 4), (1, 1)])
def test_dtfd_pseudo_bags_follow_array_split(n, groups):
    order = torch.randperm(n)[None]
    ids = pseudo_bag_ids(n, groups, order)[0]
    for g, chunk in enumerate(np.array_split(order[0].numpy(), groups)):
        assert sorted(chunk.tolist()) == torch.nonzero(ids == g).flatten().tolist()


def test_dtfd_eval_is_deterministic_and_tier2_does_not_train_tier1():
    model = build_head("dtfd", 6, 2, hidden=16, attn_dim=8).double()
    x = torch.randn(11, 6, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x))
    out = model.train().loss(x, 1)
    assert set(out) == {"loss", "per_bag", "logits", "ce", "tier1"}
    grads = torch.autograd.grad(out["ce"], list(model.reduce.parameters()), allow_unused=True)
    assert all(g is None for g in grads)
    grads = torch.autograd.grad(out["tier1"], list(model.reduce.parameters()))
    assert all(g.abs().sum() > 0 for g in grads)


def test_acmil_stkim_masks_a_share_of_the_top_instances():
    model = build_head("acmil", 4, 2, n_token=2, n_masked_patch=10, mask_drop=0.6)
    a = torch.randn(2, 15, 2)
    a[1, 4:] = float("-inf")  # second bag: 4 real instances
    masked = model._stkim(a.clone(), torch.tensor([15, 4]))
    dropped = torch.isinf(masked) & ~torch.isinf(a)
    assert dropped[0].sum(0).tolist() == [6, 6]  # floor(10 * 0.6) of the top 10
    assert dropped[1].sum(0).tolist() == [2, 2]  # floor(4 * 0.6)
    for t in range(2):
        top10 = set(torch.topk(a[0, :, t], 10).indices.tolist())
        assert set(torch.nonzero(dropped[0, :, t]).flatten().tolist()) <= top10
    model.eval()
    x = torch.randn(12, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x))


def test_acmil_diversity_is_one_for_identical_branches():
    model = build_head("acmil", 4, 2, n_token=3)
    attn = torch.softmax(torch.randn(2, 7, 1), 1).expand(2, 7, 3)
    torch.testing.assert_close(model._diversity(attn), torch.ones(2))


@pytest.mark.parametrize("n, regions", [(1, 2), (10, 2), (64, 8), (50, 3)])
def test_rrt_region_partition_roundtrip(n, regions):
    h = torch.randn(2, n, 3)
    parts, valid = region_partition(h, regions)
    assert parts.shape[0] == 2 * regions * regions and int(valid.sum()) == 2 * n
    torch.testing.assert_close(region_merge(parts, 2, n, regions), h)
    assert (parts[~valid] == 0).all()


def test_rrt_regions_are_square_blocks_of_the_grid():
    h = torch.arange(16.0).view(1, 16, 1)  # 4x4 grid, 2x2 regions of 2x2 tokens
    parts, _ = region_partition(h, 2)
    assert parts[..., 0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
