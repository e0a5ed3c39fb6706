"""The data of one loss call: this rank's rows (with autograd) and the gathered global batch (without)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GlobalBatch:
    """Rank-major global batch: rank r's rows are global positions ``r*B .. r*B+B-1``."""

    image: torch.Tensor  # [B, d] this rank's image features, autograd
    text: torch.Tensor  # [B, d] this rank's text features, autograd
    indices: torch.Tensor | None  # [B] int64 data indices of this rank's rows
    # [2, N, d] gathered (text, image) features, no autograd: the candidates of the two pair blocks (pairwise.py)
    candidates: torch.Tensor
    all_indices: torch.Tensor | None  # [N]
    rank: int
    world_size: int
    header: torch.Tensor | None = None  # [K, 4] int64 validation words of every rank (validation.py)
    momentum: torch.Tensor | None = None  # [2, N, d] the momentum model's gathered (text, image) features
    # group ids (several captions of one image): rows of one group are positives of each other, never negatives
    groups: torch.Tensor | None = None  # [B]
    all_groups: torch.Tensor | None = None  # [N]
    _positive_cells: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _indices_repeat: bool | None = field(default=None, repr=False)

    @property
    def all_text(self) -> torch.Tensor:
        """[N, d] gathered text features."""
        return self.candidates[0]

    @property
    def all_image(self) -> torch.Tensor:
        """[N, d] gathered image features."""
        return self.candidates[1]

    @property
    def local_size(self) -> int:
        return self.image.shape[0]

    @property
    def global_size(self) -> int:
        return self.all_image.shape[0]

    @property
    def offset(self) -> int:
        return self.rank * self.local_size

    @property
    def local_rows(self) -> slice:
        return slice(self.offset, self.offset + self.local_size)

    def positive_cells(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices of the cells (i, offset+i) of a ``[B, N]`` block: local row i with its own global column.

        In a row reading (local anchor i against all candidates) that cell is anchor i's positive; in a column
        reading (global anchor j against the local candidates) it is the positive of anchor offset+k.
        """
        if self._positive_cells is None:
            rows = torch.arange(self.local_size, device=self.image.device)
            self._positive_cells = (rows, rows + self.offset)
        return self._positive_cells

    def same_sample_cells(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The cells of a ``[B, N]`` block where local row i and global column j hold the same data index: the
        positives, and the copies of a sample that occurs more than once in the global batch (a resampled stream, a
        user's sampler): a copy of the anchor's own pair is not one of its negatives.

        A ``[B, N]`` bool mask; or, when the indices are in CPU memory (nothing to sync with) and none repeats, the
        positive cells as ``positive_cells()`` gives them. The same cells either way; on the CPU building and
        applying the mask costs as much as the exponentials of both blocks (B = 1024, 2 ranks)."""
        if self.all_groups is not None:  # one sample is in one group: its copies share it too
            return self.groups[:, None] == self.all_groups[None, :]
        if self.indices_repeat() is False:
            return self.positive_cells()
        return self.indices[:, None] == self.all_indices[None, :]

    def group_cells(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The cells that are positives of each other in the losses without indices (openclip, siglip): the pair
        itself, and with groups every cell of the row's group."""
        return self.same_sample_cells() if self.all_groups is not None else self.positive_cells()

    @property
    def all_ids(self) -> torch.Tensor | None:
        """``[N]`` what tells two rows apart as negatives: their group ids when given, else their data indices."""
        return self.all_groups if self.all_groups is not None else self.all_indices

    def indices_repeat(self) -> bool | None:
        """Whether some data index occurs twice in the global batch: known (one host check, cached) when the indices
        are in CPU memory; None on an accelerator, where asking would sync with the host."""
        if self._indices_repeat is None and CHECK_REPEATS_ON_HOST and self.all_indices.device.type == "cpu":
            self._indices_repeat = torch.unique(self.all_indices).numel() != self.all_indices.numel()
        return self._indices_repeat


# Whether same_sample_cells() may look at CPU indices on the host (tests turn it off to run what a CUDA step runs:
# there the check would be a host sync, so the mask is always built).
CHECK_REPEATS_ON_HOST = True
