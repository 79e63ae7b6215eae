"""Where the feature bags of a features directory live.

Three layouts are recognised, in this order:

* CLAM: ``h5_files/`` and/or ``pt_files/`` under the features directory;
* TRIDENT: ``features_<encoder>/`` directories, directly under the features directory or one level
  deeper (TRIDENT writes ``<job>/<mag>x_<size>px_<overlap>px_overlap/features_<encoder>/``). With more
  than one candidate, ``encoder`` picks it by name; without it the error lists the candidates;
* plain: ``{slide_id}.h5`` / ``{slide_id}.pt`` files in the directory itself.

When a slide has both an ``.h5`` and a ``.pt`` file, the ``.h5`` file (which may carry coordinates)
is used. Directory listings are read once, so locating thousands of slides costs no per-slide stat.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dpgs.data.errors import DataValidationError

EXTENSIONS = (".h5", ".pt")  # in order of preference
TRIDENT_PREFIX = "features_"


@dataclass
class FeatureLayout:
    """A resolved features directory: ``kind`` is plain, clam or trident; ``dirs`` are searched in order."""

    root: Path
    kind: str
    dirs: list[Path]
    encoder: str | None = None
    _index: dict[str, Path] | None = field(default=None, repr=False)

    def _build_index(self) -> dict[str, Path]:
        found: dict[str, tuple[int, Path]] = {}
        for rank_dir, directory in enumerate(self.dirs):
            with os.scandir(directory) as entries:
                for entry in entries:
                    stem, ext = os.path.splitext(entry.name)
                    if ext not in EXTENSIONS:
                        continue
                    rank = rank_dir * len(EXTENSIONS) + EXTENSIONS.index(ext)
                    if stem not in found or rank < found[stem][0]:
                        found[stem] = (rank, Path(entry.path))
        return {stem: p for stem, (_, p) in found.items()}

    def locate(self, slide_id: str) -> Path:
        """The slide's feature file, or the ``.h5`` path where it was expected when there is none."""
        if self._index is None:
            self._index = self._build_index()
        return self._index.get(slide_id, self.dirs[0] / f"{slide_id}{EXTENSIONS[0]}")

    def describe(self) -> str:
        where = ", ".join(str(d) for d in self.dirs)
        return f"{self.kind} layout ({where})"


def _trident_candidates(root: Path) -> list[Path]:
    direct = sorted(p for p in root.glob(f"{TRIDENT_PREFIX}*") if p.is_dir())
    if direct:
        return direct
    return sorted(p for p in root.glob(f"*/{TRIDENT_PREFIX}*") if p.is_dir())


def resolve_layout(features_dir: str | Path, encoder: str | None = None) -> FeatureLayout:
    """Detect the layout of ``features_dir``; raises :class:`DataValidationError` naming the problem."""
    root = Path(features_dir)
    if not root.exists():
        raise DataValidationError([f"{root}: features directory not found"])
    if not root.is_dir():
        raise DataValidationError([f"{root}: features path is not a directory"])
    clam = [root / name for name in ("h5_files", "pt_files") if (root / name).is_dir()]
    if clam:
        if encoder is not None:
            raise DataValidationError(
                [f"{root}: encoder '{encoder}' given, but this is a CLAM layout (h5_files/pt_files)"]
            )
        return FeatureLayout(root, "clam", clam)
    candidates = _trident_candidates(root)
    if candidates:
        names = [str(p.relative_to(root)) for p in candidates]
        if encoder is not None:
            chosen = [p for p in candidates if p.name == f"{TRIDENT_PREFIX}{encoder}"]
            if not chosen:
                raise DataValidationError(
                    [f"{root}: no {TRIDENT_PREFIX}{encoder}/ directory; candidates: {', '.join(names)}"]
                )
        else:
            chosen = candidates
        if len(chosen) > 1:
            which = ", ".join(str(p.relative_to(root)) for p in chosen)
            hint = "point data.features_dir at one of them" if encoder else "set data.encoder to pick one"
            raise DataValidationError([f"{root}: several TRIDENT feature directories ({which}); {hint}"])
        name = chosen[0].name[len(TRIDENT_PREFIX) :]
        return FeatureLayout(root, "trident", [chosen[0]], encoder=name)
    if encoder is not None:
        raise DataValidationError(
            [f"{root}: encoder '{encoder}' given, but there is no {TRIDENT_PREFIX}<encoder>/ directory"]
        )
    return FeatureLayout(root, "plain", [root])
