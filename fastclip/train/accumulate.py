"""Gradient accumulation that keeps the FastCLIP estimator exact for the global batch (GradCache).

The FastCLIP losses are not sums over samples: each anchor's g averages over all N-1 negatives of the global
batch, and the per-sample state u is updated once per step from that g. Backpropagating k micro-batches
through k loss calls (OpenCLIP's pre-GradCache way) would give a different estimator and k state updates.
Instead, with optim.accum_steps = k:

    the stream yields this rank's full batch of b samples; it is split into k micro-batches of b/k
    1. forward each micro-batch with no_grad, keep its features (b/k x d floats) and its RNG state
    2. call the loss ONCE on the concatenated features (leaf tensors requiring grad): it sees the same global
       batch as without accumulation (rank-major, K*b samples) and updates the per-sample state once
    3. autograd.grad of that loss -> d loss / d features (and the temperature's gradient)
    4. re-forward each micro-batch with grad, with the RNG state of step 1 (same dropout/augmentation noise),
       and backward <features, cached feature gradients>: the chain rule, micro-batch by micro-batch
       (DDP: no_sync for all but the last, so gradients are all-reduced once)
    5. one optimizer step

The parameter gradient is the one of the un-accumulated step (up to float summation order); activation memory
is that of b/k samples, at the price of one extra forward of the towers. Which backend (DDP or DeepSpeed)
runs the backward and how the temperature's gradient reaches its parameter is the caller's (engine.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

Encode = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def split_batch(images: torch.Tensor, texts: torch.Tensor, indices: torch.Tensor, k: int) -> list[tuple]:
    """k equal micro-batches (images, texts, indices), in order, so concatenating them gives the batch back."""
    b = images.shape[0]
    if b % k != 0:
        raise ValueError(f"optim.accum_steps = {k} does not divide this rank's batch of {b} samples")
    return list(zip(images.chunk(k), texts.chunk(k), indices.chunk(k)))


def rng_state(device: torch.device) -> tuple:
    """The RNG streams a forward can draw from: CPU, and the accelerator's when the towers run on one."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


class GradCache:
    """One accumulated step in two calls: `forward` (steps 1-2 above) returns the loss; `backward` (3-4) runs
    the micro-batch backwards and returns the temperature parameters' gradients."""

    def __init__(self, steps: int):
        if steps < 2:
            raise ValueError(f"GradCache needs at least 2 micro-batches, got accum_steps = {steps}")
        self.steps = steps
        self._pending: tuple | None = None

    def forward(
        self,
        encode: Encode,
        loss_fn: torch.nn.Module,
        images: torch.Tensor,
        texts: torch.Tensor,
        indices: torch.Tensor,
        epoch: int,
        encode_momentum: Callable | None = None,
        groups: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``encode_momentum``: the momentum towers' features of a micro-batch, or None (model.ema_momentum).
        ``groups``: the whole batch's group ids, for the one loss call (as the indices)."""
        micro = split_batch(images, texts, indices, self.steps)
        device = images.device
        states, image_parts, text_parts, momentum_parts = [], [], [], []
        with torch.no_grad():
            for mb_images, mb_texts, _ in micro:
                states.append(rng_state(device))
                image_features, text_features = encode(mb_images, mb_texts)
                image_parts.append(image_features)
                text_parts.append(text_features)
                momentum = encode_momentum(mb_images, mb_texts) if encode_momentum is not None else None
                if momentum is not None:
                    momentum_parts.append(momentum)
        # leaves: the loss's graph ends here, so its backward yields the feature gradients and nothing else
        image_all = torch.cat(image_parts).requires_grad_(True)
        text_all = torch.cat(text_parts).requires_grad_(True)
        del image_parts, text_parts
        momentum = tuple(torch.cat(parts) for parts in zip(*momentum_parts)) if momentum_parts else None
        loss = loss_fn(image_all, text_all, indices, epoch=epoch, momentum=momentum, groups=groups)
        self._pending = (micro, states, image_all, text_all, rng_state(device))
        return loss

    def backward(
        self,
        loss: torch.Tensor,
        encode: Encode,
        *,
        tau_params: Sequence[torch.Tensor],
        run_backward: Callable[[torch.Tensor, bool], None],
        micro_context: Callable[[bool], contextlib.AbstractContextManager] = lambda last: contextlib.nullcontext(),
        tau_in_last_backward: bool = False,
    ) -> list[torch.Tensor]:
        """Backward of `loss` (from `forward`) into the towers, one micro-batch at a time.

        run_backward(surrogate, last) backpropagates one micro-batch's surrogate <features, cached gradients>
        (inside micro_context(last), which also covers that micro-batch's re-forward: DDP's no_sync).
        The temperature gradients are returned; with tau_in_last_backward they are also put into the last
        micro-batch's surrogate as <p, grad p>, so that a DDP that holds the temperature reduces them with
        the towers' gradients (its reducer expects every parameter's gradient in the synchronised backward).
        """
        if self._pending is None:
            raise RuntimeError("GradCache.backward without a forward")
        micro, states, image_all, text_all, after_loss = self._pending
        self._pending = None
        tau_params = list(tau_params)
        grads = torch.autograd.grad(loss, [image_all, text_all, *tau_params], allow_unused=True)
        image_grad, text_grad = (
            torch.zeros_like(t) if g is None else g for t, g in zip((image_all, text_all), grads[:2])
        )
        tau_grads = [torch.zeros_like(p) if g is None else g for p, g in zip(tau_params, grads[2:])]
        del grads, image_all, text_all
        device, start = image_grad.device, 0
        for j, ((mb_images, mb_texts, _), state) in enumerate(zip(micro, states)):
            last = j == len(micro) - 1
            rows = slice(start, start + mb_images.shape[0])
            start = rows.stop
            set_rng_state(state, device)  # the noise of the cached forward
            with micro_context(last):
                image_features, text_features = encode(mb_images, mb_texts)
                surrogate = (image_features * image_grad[rows]).sum() + (text_features * text_grad[rows]).sum()
                if last and tau_in_last_backward:
                    for p, g in zip(tau_params, tau_grads):
                        surrogate = surrogate + (p * g).sum()
                run_backward(surrogate, last)
        set_rng_state(after_loss, device)
        return tau_grads

    def discard(self) -> None:
        """Drop the cached micro-batches of a step that will not be backpropagated (a skipped step)."""
        self._pending = None


__all__ = ["GradCache", "split_batch", "rng_state", "set_rng_state"]
