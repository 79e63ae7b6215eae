import math

import numpy as np
import pytest

from dpgs.metrics import auc_score, average_ranks, classification_metrics, confusion


def test_binary_perfect_and_inverted():
    y = np.array([0, 0, 1, 1])
    good = np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.1, 0.9]])
    m = classification_metrics(y, good)
    assert m["acc"] == 1.0 and m["auc"] == 1.0 and m["bacc"] == 1.0 and m["f1"] == 1.0 and m["qwk"] == 1.0
    assert auc_score(y, good[:, ::-1]) == 0.0


def test_multiclass_macro_ovr_auc_and_qwk():
    y = np.array([0, 1, 2, 3, 3])
    probs = np.eye(4)[[0, 1, 3, 3, 2]] * 0.7 + 0.075
    m = classification_metrics(y, probs)
    assert m["acc"] == pytest.approx(3 / 5)
    # QWK penalises the 2<->3 confusions by (1/3)^2 each: strictly between 0.5 and 1
    assert 0.5 < m["qwk"] < 1.0
    assert 0.5 < m["auc"] < 1.0
    np.testing.assert_array_equal(confusion(y, probs).sum(axis=1), [1, 1, 1, 2])


def test_auc_undefined_for_one_class():
    assert math.isnan(auc_score(np.array([1, 1]), np.array([[0.2, 0.8], [0.6, 0.4]])))


def test_shape_errors():
    with pytest.raises(ValueError, match="expected y"):
        classification_metrics([0, 1], np.ones((3, 2)) / 2)


@pytest.mark.parametrize("shape, distinct", [((1,), 1), ((7,), 7), ((50,), 4), ((30, 40), 6), ((3, 5, 9), 2)])
def test_average_ranks_equal_scipys_with_and_without_ties(shape, distinct):
    from scipy.stats import rankdata

    rng = np.random.default_rng(len(shape) * 100 + distinct)
    values = rng.integers(0, distinct, shape).astype(np.float32) / distinct  # ties unless distinct >= n
    np.testing.assert_array_equal(average_ranks(values), rankdata(values, method="average", axis=-1))
    unique = rng.permutation(shape[-1]).astype(np.float64)
    np.testing.assert_array_equal(average_ranks(unique), unique + 1)


def test_a_metric_imports_neither_scipy_nor_scikit_learn():
    """The first validation of a run no longer pays ``scipy.stats``' import (1.0-1.3 s on 2 cores)."""
    import subprocess
    import sys

    code = ("import sys, numpy as np; from dpgs.metrics import classification_metrics, bootstrap_ci; "
            "y = np.array([0, 1, 1, 0]); p = np.array([[.9, .1], [.2, .8], [.4, .6], [.5, .5]]); "
            "classification_metrics(y, p); bootstrap_ci(y, p, resamples=50); "
            "print(sorted(m for m in ('scipy', 'sklearn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def random_probs(rng, n, c, decimals=2):
    """Rounded (tied) class probabilities [n, c]."""
    return np.round(rng.dirichlet(np.ones(c), n), decimals)


def sklearn_macro_ovr_auc(y, probs):
    """sklearn's one-vs-rest macro AUC (without its check that rounded rows sum to 1)."""
    from sklearn.metrics import roc_auc_score

    return np.mean([roc_auc_score(y == c, probs[:, c]) for c in range(probs.shape[1])])


@pytest.mark.parametrize("classes", [2, 4])
def test_accuracy_balanced_accuracy_and_auc_equal_sklearn(classes):
    from sklearn.metrics import accuracy_score, balanced_accuracy_score, roc_auc_score

    rng = np.random.default_rng(classes)
    y = rng.integers(0, classes, 300)
    probs = random_probs(rng, 300, classes)
    m = classification_metrics(y, probs)
    assert m["acc"] == pytest.approx(accuracy_score(y, probs.argmax(1)))
    assert m["bacc"] == pytest.approx(balanced_accuracy_score(y, probs.argmax(1)))
    expected = roc_auc_score(y, probs[:, 1]) if classes == 2 else sklearn_macro_ovr_auc(y, probs)
    assert m["auc"] == pytest.approx(expected)


@pytest.mark.parametrize("classes", [2, 3, 5])
def test_f1_qwk_and_confusion_equal_sklearn_also_with_classes_never_predicted_or_absent(classes):
    from sklearn.metrics import cohen_kappa_score, confusion_matrix, f1_score

    rng = np.random.default_rng(10 + classes)
    labels = np.arange(classes)
    for n in (1, 2, 7, 40, 300):
        for _ in range(20):
            y = rng.integers(0, max(classes - 1, 1), n)  # the last class never a label
            probs = random_probs(rng, n, classes)
            probs[:, 0] *= rng.choice([1.0, 0.0])  # sometimes class 0 is never predicted
            pred = probs.argmax(1)
            m = classification_metrics(y, probs)
            np.testing.assert_array_equal(confusion(y, probs), confusion_matrix(y, pred, labels=labels))
            f1 = f1_score(y, pred, labels=labels, average="macro", zero_division=0)
            assert m["f1"] == pytest.approx(f1)
            if len(set(y.tolist()) | set(pred.tolist())) > 1:  # else sklearn's kappa is 0 / 0
                kappa = cohen_kappa_score(y, pred, labels=labels, weights="quadratic")
                assert m["qwk"] == pytest.approx(kappa)


def test_one_class_labelled_and_predicted_is_perfect_agreement():
    m = classification_metrics([1, 1, 1], [[0.2, 0.8], [0.4, 0.6], [0.0, 1.0]])
    assert m["qwk"] == 1.0 and m["f1"] == 0.5  # class 0: no true and no predicted bag counts 0
    assert m["acc"] == 1.0


def test_labels_outside_the_classes_are_refused():
    with pytest.raises(ValueError, match=r"labels must be class indices in \[0, 2\), got \[0, 2\]"):
        classification_metrics([0, 2], np.eye(2))


def test_ci_of_a_perfect_classifier_is_one_one():
    from dpgs.metrics import bootstrap_ci

    y = np.array([0] * 20 + [1] * 30)
    probs = np.eye(2)[y] * 0.8 + 0.1
    for name, ci in bootstrap_ci(y, probs, resamples=1000, seed=3).items():
        assert (ci.low, ci.high) == (1.0, 1.0), name


def test_ci_of_a_random_classifier_contains_one_half():
    from dpgs.metrics import bootstrap_ci

    rng = np.random.default_rng(11)
    y = rng.integers(0, 2, 200)
    probs = random_probs(rng, 200, 2, decimals=6)
    cis = bootstrap_ci(y, probs, resamples=1000, level=0.95, seed=0)
    for name, ci in cis.items():
        assert ci.low < 0.5 < ci.high, (name, ci)
        assert ci.high - ci.low < 0.3


def test_bootstrap_is_stratified_seeded_and_a_percentile_interval():
    from dpgs.metrics import bootstrap_ci, stratified_resamples

    rng = np.random.default_rng(2)
    y = np.array([0] * 12 + [1] * 7 + [2] * 5)
    probs = random_probs(rng, y.size, 3)
    rows = stratified_resamples(y, 400, seed=9)
    assert rows.shape == (400, y.size)
    assert all(np.array_equal(np.bincount(y[r], minlength=3), [12, 7, 5]) for r in rows)  # class counts kept
    reference = [sklearn_macro_ovr_auc(y[r], probs[r]) for r in rows]
    ci = bootstrap_ci(y, probs, ("auc",), resamples=400, level=0.9, seed=9)["auc"]
    assert (ci.low, ci.high) == pytest.approx(tuple(np.percentile(reference, [5, 95])))
    assert bootstrap_ci(y, probs, ("auc",), 400, 0.9, seed=9)["auc"] == ci
    assert bootstrap_ci(y, probs, ("auc",), 400, 0.9, seed=10)["auc"] != ci


def test_ci_is_undefined_for_one_class_and_empty_sets():
    from dpgs.metrics import bootstrap_ci

    one_class = bootstrap_ci(np.array([1, 1, 1]), np.array([[0.2, 0.8]] * 3), resamples=10)
    assert math.isnan(one_class["auc"].low) and one_class["acc"].low == 1.0
    assert math.isnan(bootstrap_ci(np.zeros(0, int), np.zeros((0, 2)), resamples=10)["acc"].high)
    with pytest.raises(ValueError, match="no bootstrap interval for"):
        bootstrap_ci([0, 1], np.eye(2), ("f1",))
