"""A FIFO of past features (MoCo, He et al. 2020; Cross-Batch Memory, Wang et al. 2020): the last Q rows of the
gathered batches, image, text and data index, as extra negatives of the autograd objectives (``queue_size``).

Every rank pushes the same gathered rows, so the queue is identical on every rank and costs no collective: per
rank 2·Q·d values (Q = 65,536, d = 512, float32: 256 MiB) plus Q int64 indices, and a push makes new tensors
(the call's graph keeps the entries it read for its backward), so twice that at the peak. Entries carry no gradient. An
empty slot has index −1; an entry of an anchor's own sample (the same data index seen before) is no negative.

It is the loss's state: saved in its ``state_dict`` (``queue.*`` keys; identical on every rank, so a change of
world size keeps it as it is), and journaled like the per-sample state, so the trainer's NaN rollback restores
it (``rollback``). The position is a tensor: a push and a rollback make no host sync.
"""

from __future__ import annotations

import torch

KEYS = ("image", "text", "indices", "position")


class FeatureQueue:
    def __init__(self, size: int):
        self.size = int(size)
        self.image: torch.Tensor | None = None  # [Q, d], allocated at the first push (d, dtype and device known)
        self.text: torch.Tensor | None = None
        self.indices: torch.Tensor | None = None  # [Q] int64, −1 where empty
        self.position: torch.Tensor | None = None  # 0-d int64: the next slot to write
        # when a list: every push first appends what it overwrites, so a skipped step can be undone (rollback)
        self.journal: list | None = None

    def allocated(self) -> bool:
        return self.image is not None

    def _allocate(self, like: torch.Tensor) -> None:
        d = like.shape[1]
        self.image = like.new_zeros(self.size, d)
        self.text = like.new_zeros(self.size, d)
        self.indices = torch.full((self.size,), -1, dtype=torch.int64, device=like.device)
        self.position = torch.zeros((), dtype=torch.int64, device=like.device)

    def entries(self, like: torch.Tensor):
        """``(image, text, indices)`` in ``like``'s dtype and device (allocated empty if nothing was pushed)."""
        if not self.allocated():
            self._allocate(like.detach())
        elif self.image.device != like.device or self.image.dtype != like.dtype:
            self.to_(like.device, like.dtype)
        return self.image, self.text, self.indices

    def to_(self, device, dtype) -> None:
        self.image, self.text = self.image.to(device, dtype), self.text.to(device, dtype)
        self.indices, self.position = self.indices.to(device), self.position.to(device)

    @torch.no_grad()
    def push(self, image: torch.Tensor, text: torch.Tensor, indices: torch.Tensor) -> None:
        """Enqueue the rows (the newest last), dropping the oldest; more rows than slots keep the last Q."""
        self.entries(image)
        image, text, indices = image[-self.size :], text[-self.size :], indices[-self.size :]
        slots = (self.position + torch.arange(len(indices), device=indices.device)) % self.size
        if self.journal is not None:
            self.journal.append((slots, self.image[slots], self.text[slots], self.indices[slots], self.position))
        # out of place: this call's graph holds the entries as they were, for its backward
        self.image = self.image.index_copy(0, slots, image.detach().to(self.image.dtype))
        self.text = self.text.index_copy(0, slots, text.detach().to(self.text.dtype))
        self.indices = self.indices.index_copy(0, slots, indices.to(torch.int64))
        self.position = (self.position + len(indices)) % self.size

    @torch.no_grad()
    def rollback(self, undo: torch.Tensor | None = None) -> None:
        """Undo the journal's pushes, newest first, and empty it; with ``undo`` (0-d bool on the device) only where
        it is true, without a host read."""
        for slots, image, text, indices, position in reversed(self.journal or []):
            if undo is not None:
                keep = ~undo.to(self.image.device)
                image = torch.where(keep, self.image[slots], image)
                text = torch.where(keep, self.text[slots], text)
                indices = torch.where(keep, self.indices[slots], indices)
                position = torch.where(keep, self.position, position)
            self.image = self.image.index_copy(0, slots, image)
            self.text = self.text.index_copy(0, slots, text)
            self.indices = self.indices.index_copy(0, slots, indices)
            self.position = position
        if self.journal is not None:
            self.journal.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        if not self.allocated():
            return {}
        return {"image": self.image, "text": self.text, "indices": self.indices, "position": self.position}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if not state:  # saved before the first push
            self.image = self.text = self.indices = self.position = None
            return
        missing = [key for key in KEYS if key not in state]
        size = state["indices"].shape[0] if "indices" in state else None
        if missing or size != self.size:
            raise ValueError(
                f"the saved feature queue has {size} slots (missing {missing}) but the loss has queue_size="
                f"{self.size}: resume with the saved queue_size"
            )
        self.image, self.text = state["image"].clone(), state["text"].clone()
        self.indices, self.position = state["indices"].clone(), state["position"].clone()
