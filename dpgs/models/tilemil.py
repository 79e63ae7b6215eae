"""``TileMIL``: a tile encoder (big-layer ResNet) followed by a MIL head, trained end to end on tile bags.

Shapes follow the heads (``dpgs.models.base``) with images in place of feature vectors: one bag ``x``
[N, 3, s, s] -> logits [C]; a batch [B, N, 3, s, s] (optional ``mask`` [B, N]) -> [B, C]; packed bags
[sum N_b, 3, s, s] with ``lengths`` [B] -> [B, C].

Embedding contract (what makes every training mode and DPGS agree):

* **One encoder pass per bag.** In training mode the encoder sees the N tiles of one bag at once, so
  training-mode BatchNorm normalises with the statistics of that bag's tiles (exact over the whole bag
  thanks to the big layers' Welford pass), never with statistics mixed across the bags of a step. A
  bag's embedding therefore depends on its own tiles only, and a step's gradient is the same whether its
  bags run in one process (packed, padding, sampling) or are spread over DPGS workers.
* Without gradients in eval mode (validation, ``dpgs extract``, heatmaps) BatchNorm uses its running
  statistics, so the bag is embedded in chunks of ``embed_chunk`` tiles to bound memory; the result
  equals the one-pass embedding.
* ``amp=True`` runs the encoder under ``torch.autocast`` with bfloat16 on its device (the big layers
  compute each strip in bfloat16 and keep float32 statistics); the head and the loss stay float32.
  bfloat16 has float32's range, so no loss scaling is needed.
* ``freeze_encoder=True`` is the frozen baseline: the encoder's parameters do not require gradients
  (DPGS sends and the optimizer steps the head only), the encoder stays in eval mode (running
  statistics, unchanged buffers) and embeddings are computed on the fly under ``no_grad``.

Tiles may stay in host memory: the encoder moves strips (big stages) or the activation after the big
stages to its device itself (``host_input = True``), and the head runs on the encoder's device.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dpgs.biglayers import BigResNet, resnet18, resnet50
from dpgs.models.base import MILHead

ENCODERS = {"resnet18": resnet18, "resnet50": resnet50}


def build_encoder(name: str, big_stages: int = 1, max_elements: int = 1 << 24) -> BigResNet:
    """A feature-extractor ResNet (``num_classes=0``: pooled features) on the CPU."""
    if name not in ENCODERS:
        raise ValueError(f"model.encoder: unknown encoder '{name}' (available: {', '.join(ENCODERS)})")
    return ENCODERS[name](big_stages=big_stages, max_elements=max_elements, num_classes=0, device="cpu")


def load_encoder_weights(encoder: BigResNet, path: str | Path) -> None:
    """Load a torchvision-format ResNet state_dict (``fc.*`` ignored) with ``weights_only=True``.

    Also accepted: a dict with a ``state_dict`` entry, and keys prefixed ``module.`` or ``encoder.``
    (a DataParallel checkpoint or a dpgs ``best.pt``). Raises ValueError naming the file and the keys
    that do not match.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"model.encoder_weights: {path} not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle errors, truncated files, non-tensor content
        raise ValueError(f"model.encoder_weights: {path} is not a readable state_dict ({err})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"model.encoder_weights: {path} holds a {type(state).__name__}, not a state_dict")
    if any(k.startswith("encoder.") for k in state):
        state = {k[len("encoder.") :]: v for k, v in state.items() if k.startswith("encoder.")}
    state = {k.removeprefix("module."): v for k, v in state.items()}
    own = {k for k in encoder.state_dict()}
    given = {k for k in state if not k.startswith("fc.")}
    missing, unexpected = sorted(own - given), sorted(given - own)
    if missing or unexpected:
        raise ValueError(
            f"model.encoder_weights: {path} does not fit the encoder: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''} ({len(missing)} missing, {len(unexpected)} unexpected)"
        )
    try:
        encoder.load_state_dict(state)
    except RuntimeError as err:  # shape mismatch (resnet50 weights into a resnet18, say)
        raise ValueError(f"model.encoder_weights: {path} does not fit the encoder: {err}") from None


class TileMIL(nn.Module):
    """Encoder + MIL head over bags of tiles (see module docstring)."""

    host_input = True

    def __init__(self, encoder: BigResNet, head: MILHead, freeze_encoder: bool = False,
                 embed_chunk: int = 256, amp: bool = False):
        super().__init__()
        if head.in_dim != encoder.feature_dim:
            raise ValueError(f"head in_dim {head.in_dim} != encoder feature dim {encoder.feature_dim}")
        if embed_chunk < 1:
            raise ValueError(f"embed_chunk must be >= 1, got {embed_chunk}")
        self.encoder = encoder
        self.head = head
        self.freeze_encoder = bool(freeze_encoder)
        self.embed_chunk = int(embed_chunk)
        self.amp = bool(amp)
        self.name = head.name
        self.supports_mask = head.supports_mask
        if self.freeze_encoder:
            self.encoder.requires_grad_(False)
            self.encoder.eval()

    def train(self, mode: bool = True) -> TileMIL:
        super().train(mode)
        if self.freeze_encoder:
            self.encoder.eval()
        return self

    # ------------------------------------------------------------------ embedding
    def _check_tiles(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != 3 or x.shape[0] < 1:
            raise ValueError(f"{self.name}: expected a bag of tiles [N, 3, s, s] with N >= 1, got "
                             f"{tuple(x.shape)}")

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """[N, 3, s, s] tiles of one bag -> [N, feature_dim] on the encoder's device."""
        self._check_tiles(x)
        one_pass = self.encoder.training and torch.is_grad_enabled() and not self.freeze_encoder
        grad = torch.is_grad_enabled() and not self.freeze_encoder
        with torch.autocast(self.encoder.device.type, dtype=torch.bfloat16, enabled=self.amp), \
                torch.set_grad_enabled(grad):
            if one_pass:
                feats = self.encoder(x)
            else:
                feats = torch.cat([self.encoder(c) for c in torch.split(x, self.embed_chunk)])
        return feats.float() if self.amp else feats  # bf16 autocast output -> the head's float32

    def _embed_batch(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """[B, N, 3, s, s] (+ mask) -> [B, N, D]: each bag's real tiles embedded in its own pass."""
        if x.dim() != 5:
            raise ValueError(f"{self.name}: expected a batch of tiles [B, N, 3, s, s], got {tuple(x.shape)}")
        rows = []
        for b in range(x.shape[0]):
            keep = slice(None) if mask is None else mask[b].to(x.device)
            feats = self.embed(x[b][keep])
            if mask is None:
                rows.append(feats)
            else:
                full = feats.new_zeros((x.shape[1], feats.shape[1]))
                full[mask[b].to(feats.device)] = feats
                rows.append(full)
        return torch.stack(rows)

    def _embed_packed(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if lengths.dim() != 1 or int(lengths.sum()) != x.shape[0]:
            raise ValueError(
                f"{self.name}: lengths must sum to x.shape[0]={x.shape[0]}, got {lengths.tolist()}"
            )
        return torch.cat([self.embed(chunk) for chunk in torch.split(x, lengths.tolist())])

    def _head_mask(self, mask: torch.Tensor | None, feats: torch.Tensor) -> torch.Tensor | None:
        return None if mask is None else mask.to(feats.device)

    # ------------------------------------------------------------------ the head interface
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [C] of one bag [N, 3, s, s], or [B, C] of a batch [B, N, 3, s, s] (optional mask)."""
        if x.dim() == 4:
            if mask is not None:
                raise ValueError(f"{self.name}: a mask is only valid with a batch [B, N, 3, s, s]")
            return self.head(self.embed(x))
        feats = self._embed_batch(x, mask)
        return self.head(feats, self._head_mask(mask, feats))

    def forward_packed(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        feats = self._embed_packed(x, lengths)
        return self.head.forward_packed(feats, lengths.to(feats.device))

    def loss(self, x: torch.Tensor, y, mask: torch.Tensor | None = None, class_weights=None) -> dict:
        """The head's loss dictionary on the embedded bag(s)."""
        if x.dim() == 4:
            if mask is not None:
                raise ValueError(f"{self.name}: a mask is only valid with a batch [B, N, 3, s, s]")
            feats = self.embed(x)
            return self.head.loss(feats, torch.as_tensor(y, device=feats.device), class_weights=class_weights)
        feats = self._embed_batch(x, mask)
        y = torch.as_tensor(y, device=feats.device)
        return self.head.loss(feats, y, mask=self._head_mask(mask, feats), class_weights=class_weights)

    def loss_packed(self, x: torch.Tensor, lengths: torch.Tensor, y: torch.Tensor,
                    class_weights=None) -> dict:
        feats = self._embed_packed(x, lengths)
        y = torch.as_tensor(y, device=feats.device)
        return self.head.loss_packed(feats, lengths.to(feats.device), y, class_weights=class_weights)

    def instance_scores(self, x: torch.Tensor) -> torch.Tensor:
        """[N] per-tile score of one bag (the head's attention weight or positive-class probability)."""
        return self.head.instance_scores(self.embed(x))
