import math

import numpy as np
import pytest

from dpgs.metrics import auc_score, classification_metrics, confusion


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
