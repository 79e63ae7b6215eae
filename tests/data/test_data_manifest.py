import pytest

from dpgs.data import DataValidationError, load_manifest
from tests.data_helpers import write_csv, write_h5


@pytest.fixture
def feats(tmp_path):
    d = tmp_path / "feats"
    for sid in ("a", "b", "c", "d"):
        write_h5(d / f"{sid}.h5")
    return d


def test_integer_labels_sorted_numerically(tmp_path, feats):
    csv = write_csv(tmp_path / "m.csv", ["slide_id", "label"], [["a", 10], ["b", 2], ["c", 1], ["d", "02"]])
    m = load_manifest(csv, feats)
    assert m.classes == ["1", "2", "10"]
    assert [r.label for r in m.records] == [2, 1, 0, 1]
    assert m.records[3].label_name == "2"


def test_string_labels_map_stably_whatever_the_row_order(tmp_path, feats):
    rows = [["a", "tumor"], ["b", "normal"], ["c", "benign"], ["d", "tumor"]]
    m1 = load_manifest(write_csv(tmp_path / "1.csv", ["slide_id", "label"], rows), feats)
    m2 = load_manifest(write_csv(tmp_path / "2.csv", ["slide_id", "label"], rows[::-1]), feats)
    assert m1.classes == m2.classes == ["benign", "normal", "tumor"]
    assert {r.slide_id: r.label for r in m1.records} == {r.slide_id: r.label for r in m2.records}
    assert {r.slide_id: r.label for r in m1.records} == {"a": 2, "b": 1, "c": 0, "d": 2}


def test_forced_class_order_and_defaults(tmp_path, feats):
    csv = write_csv(
        tmp_path / "m.csv", ["Slide_ID", " label ", "case_id"], [["a", "x", "p1"], ["b", "y", ""]]
    )
    m = load_manifest(csv, feats, classes=["y", "x"])
    assert m.classes == ["y", "x"]
    assert [r.label for r in m.records] == [1, 0]
    assert [r.case_id for r in m.records] == ["p1", "b"]  # case_id defaults to the slide id
    assert all(r.split is None for r in m.records)
    assert m.records[0].path == feats / "a.h5"
    assert m.records[1].row == 3


def test_unknown_label_names_file_and_row(tmp_path, feats):
    csv = write_csv(tmp_path / "m.csv", ["slide_id", "label"], [["a", "x"], ["b", "z"]])
    with pytest.raises(DataValidationError) as err:
        load_manifest(csv, feats, classes=["x", "y"])
    assert err.value.problems == [f"{csv}, row 3: unknown label 'z' for slide 'b' (known classes: x, y)"]


def test_duplicate_slide_and_bad_split_and_empty_fields(tmp_path, feats):
    rows = [["a", 0, "train"], ["a", 1, "val"], ["b", 1, "holdout"], ["", 0, "test"], ["c", "", "test"]]
    csv = write_csv(tmp_path / "m.csv", ["slide_id", "label", "split"], rows)
    with pytest.raises(DataValidationError) as err:
        load_manifest(csv, feats)
    problems = err.value.problems
    assert f"{csv}, row 3: duplicate slide_id 'a' (first on row 2)" in problems
    assert f"{csv}, row 4: split 'holdout' for slide 'b' is not one of train, val, test" in problems
    assert f"{csv}, row 5: empty slide_id" in problems
    assert f"{csv}, row 6: empty label for slide 'c'" in problems
    assert len(problems) == 4
    assert "4 input problems found:" in str(err.value)


def test_missing_columns_and_ragged_rows(tmp_path, feats):
    csv = tmp_path / "m.csv"
    csv.write_text("slide,label\na,1\nb,1,extra\n")
    with pytest.raises(DataValidationError) as err:
        load_manifest(csv, feats)
    assert f"{csv}: missing column 'slide_id' (columns are: slide, label)" in err.value.problems
    assert f"{csv}, row 3: 3 fields, the header has 2" in err.value.problems


def test_missing_and_empty_manifest(tmp_path, feats):
    with pytest.raises(DataValidationError, match="manifest file not found"):
        load_manifest(tmp_path / "nope.csv", feats)
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DataValidationError, match="empty.csv: manifest is empty"):
        load_manifest(tmp_path / "empty.csv", feats)


def test_non_strict_collects_problems(tmp_path, feats):
    csv = write_csv(tmp_path / "m.csv", ["slide_id", "label"], [["a", "x"], ["b", "q"]])
    m = load_manifest(csv, feats, classes=["x"], strict=False)
    assert [r.label for r in m.records] == [0, -1]
    assert len(m.problems) == 1 and "row 3" in m.problems[0]


def test_slide_id_must_be_a_file_name(tmp_path, feats):
    csv = write_csv(tmp_path / "m.csv", ["slide_id", "label"], [["../a", 0], ["b", 1]])
    with pytest.raises(DataValidationError, match=r"row 2: slide_id '\.\./a' is not a file name"):
        load_manifest(csv, feats)


def test_a_stray_text_label_among_integers_is_refused_naming_its_rows(tmp_path, feats):
    rows = [["a", 0], ["b", 1], ["c", "banana"], ["d", 1]]
    csv = write_csv(tmp_path / "m.csv", ["slide_id", "label"], rows)
    with pytest.raises(DataValidationError) as err:
        load_manifest(csv, feats)
    assert err.value.problems == [
        f"{csv}, row 4: label 'banana' for slide 'c' is not an integer but the other 3 labels are integers"
    ]
    rows = [["a", "tumour"], ["b", "normal"], ["c", "7"], ["d", "normal"]]
    csv = write_csv(tmp_path / "m.csv", ["slide_id", "label"], rows)
    with pytest.raises(DataValidationError, match=r"row 4: label '7' for slide 'c' is an integer but"):
        load_manifest(csv, feats)
