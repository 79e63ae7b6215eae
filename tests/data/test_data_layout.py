import pytest

from dpgs.data import DataValidationError, load_manifest, resolve_layout
from tests.data_helpers import write_csv, write_h5, write_pt


def test_plain_layout_prefers_h5_over_pt(tmp_path):
    write_h5(tmp_path / "a.h5")
    write_pt(tmp_path / "a.pt")
    write_pt(tmp_path / "b.pt")
    layout = resolve_layout(tmp_path)
    assert layout.kind == "plain"
    assert layout.locate("a") == tmp_path / "a.h5"
    assert layout.locate("b") == tmp_path / "b.pt"
    assert layout.locate("zz") == tmp_path / "zz.h5"  # expected location of a missing file


def test_clam_layout_h5_files_then_pt_files(tmp_path):
    write_h5(tmp_path / "h5_files" / "a.h5")
    write_pt(tmp_path / "pt_files" / "a.pt")
    write_pt(tmp_path / "pt_files" / "b.pt")
    layout = resolve_layout(tmp_path)
    assert layout.kind == "clam"
    assert layout.locate("a") == tmp_path / "h5_files" / "a.h5"
    assert layout.locate("b") == tmp_path / "pt_files" / "b.pt"


def test_clam_pt_only(tmp_path):
    write_pt(tmp_path / "pt_files" / "a.pt")
    layout = resolve_layout(tmp_path)
    assert layout.dirs == [tmp_path / "pt_files"]
    assert layout.locate("a") == tmp_path / "pt_files" / "a.pt"


def test_trident_single_encoder_is_picked(tmp_path):
    write_h5(tmp_path / "features_uni_v1" / "a.h5")
    layout = resolve_layout(tmp_path)
    assert (layout.kind, layout.encoder) == ("trident", "uni_v1")
    assert layout.locate("a") == tmp_path / "features_uni_v1" / "a.h5"


def test_trident_several_encoders_need_a_choice(tmp_path):
    for enc in ("conch_v15", "uni_v1"):
        write_h5(tmp_path / f"features_{enc}" / "a.h5")
    with pytest.raises(DataValidationError) as err:
        resolve_layout(tmp_path)
    msg = str(err.value)
    assert "features_conch_v15, features_uni_v1" in msg and "data.encoder" in msg
    assert (
        resolve_layout(tmp_path, encoder="conch_v15").locate("a") == tmp_path / "features_conch_v15" / "a.h5"
    )
    with pytest.raises(
        DataValidationError, match="no features_gigapath/ directory; candidates: features_conch"
    ):
        resolve_layout(tmp_path, encoder="gigapath")


def test_trident_job_directory_one_level_up(tmp_path):
    write_h5(tmp_path / "20x_256px_0px_overlap" / "features_uni_v1" / "a.h5")
    write_h5(tmp_path / "10x_256px_0px_overlap" / "features_uni_v1" / "a.h5")
    with pytest.raises(DataValidationError) as err:
        resolve_layout(tmp_path, encoder="uni_v1")
    assert "10x_256px_0px_overlap/features_uni_v1, 20x_256px_0px_overlap/features_uni_v1" in str(err.value)
    layout = resolve_layout(tmp_path / "20x_256px_0px_overlap")
    assert layout.locate("a") == tmp_path / "20x_256px_0px_overlap" / "features_uni_v1" / "a.h5"


def test_missing_dir_and_encoder_mismatch(tmp_path):
    with pytest.raises(DataValidationError, match="nope: features directory not found"):
        resolve_layout(tmp_path / "nope")
    write_h5(tmp_path / "a.h5")
    with pytest.raises(DataValidationError, match="no features_<encoder>/ directory"):
        resolve_layout(tmp_path, encoder="uni")
    with pytest.raises(DataValidationError, match="is not a directory"):
        resolve_layout(tmp_path / "a.h5")


def test_manifest_uses_layout_and_reports_manifest_problems_with_layout_error(tmp_path):
    write_h5(tmp_path / "f" / "h5_files" / "s1.h5")
    csv = write_csv(tmp_path / "m.csv", ["slide_id", "label"], [["s1", 0]])
    m = load_manifest(csv, tmp_path / "f")
    assert m.layout.kind == "clam" and m.records[0].path == tmp_path / "f" / "h5_files" / "s1.h5"
    bad = write_csv(tmp_path / "bad.csv", ["slide_id", "lbl"], [["s1", 0]])
    with pytest.raises(DataValidationError) as err:
        load_manifest(bad, tmp_path / "missing")
    assert len(err.value.problems) == 2
    assert "missing column 'label'" in err.value.problems[0]
    assert "features directory not found" in err.value.problems[1]
