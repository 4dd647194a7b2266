"""Sink diagnostics: how each layer's attention is spent, measured on a validation batch.

Per layer, averaged over heads and over query positions ``i >= WINDOW`` (earlier rows trivially keep
all their mass within the last ``WINDOW`` keys and say nothing):

* ``attn_sink_mass``: probability on key 0, the first token of the window (where sinks form);
* ``attn_entropy``: entropy of the attention row, in nats;
* ``attn_local_mass``: probability on the last ``WINDOW`` keys ``i - WINDOW < j <= i``.

Why hooks and the model's own ``_attend``: the probabilities are those of the model's actual attention
(GOAT lanes, RoPE, ALiBi, masks, whatever the position scheme and its current implementation), not of a
re-derivation. ``_attend(q, k, V)`` with ``V`` the one-hot code of the keys returns the probability rows
themselves (``P @ V = P``); key chunks of ``KEY_CHUNK`` bound the memory. A hook on each attention's
``qkv`` projection takes its output during an ordinary forward pass (the eval pass), so the model runs
once. Statistics are summed over this rank's heads and reduced over the model's TP group
(``model.tp_group``, its ``layout``'s).
"""

from __future__ import annotations

import torch

from .. import collectives
from ..goat import split_grouped_qkv

WINDOW = 64
KEY_CHUNK = 256
FIELDS = ("attn_sink_mass", "attn_entropy", "attn_local_mass")


@torch.no_grad()
def attention_probabilities(attn, q, k, position_ids, segments=None, key_chunk: int = KEY_CHUNK):
    """Yield ``(first key, P[..., keys])`` chunks of the probabilities (B, L, H, chunk) of ``attn``."""
    B, S, H_kv = k.shape[:3]
    backend = attn.backend
    if backend == "flash":  # flash-attn 2 needs v's head dim equal to q's; the math is the same
        attn.backend = "sdpa"
    try:
        for first in range(0, S, key_chunk):
            width = min(key_chunk, S - first)
            onehot = torch.zeros(B, S, H_kv, width, dtype=q.dtype, device=q.device)
            cols = torch.arange(width, device=q.device)
            onehot[:, first + cols, :, cols] = 1.0
            yield first, attn._attend(q, k, onehot, position_ids, segments).float()
    finally:
        attn.backend = backend


@torch.no_grad()
def layer_sums(attn, mixed, position_ids, segments, window: int = WINDOW) -> torch.Tensor:
    """[sink mass, entropy, local mass, rows] summed over this rank's heads and the counted rows."""
    q, k, _ = split_grouped_qkv(mixed, attn.local_kv_heads, attn.group, attn.content_dim, attn.head_dim)
    B, L, H = q.shape[:3]
    device = q.device
    i = torch.arange(L, device=device)
    counted = i >= window if L > window else i >= 1
    entropy = torch.zeros(B, L, H, device=device)
    local = torch.zeros(B, L, H, device=device)
    sink = None
    for first, p in attention_probabilities(attn, q, k, position_ids, segments):
        j = first + torch.arange(p.shape[-1], device=device)
        entropy -= torch.special.xlogy(p, p).sum(-1)
        near = (j[None, :] > i[:, None] - window)[None, :, None, :]
        local += (p * near).sum(-1)
        if sink is None:
            sink = p[..., 0]
    rows = counted[None, :, None]
    return torch.stack(
        [
            (sink * rows).sum(),
            (entropy * rows).sum(),
            (local * rows).sum(),
            rows.sum() * B * H,
        ]
    ).double()


class AttentionProbe:
    """``with AttentionProbe(model) as probe: model(...)`` then ``probe.result()`` (collective over TP).

    Only the probe's first forward pass is measured, on its first ``sequences`` sequences."""

    def __init__(self, model, sequences: int = 2):
        self.model, self.sequences = model, sequences
        self.sums: dict[int, torch.Tensor] = {}
        self._inputs: dict[int, tuple] = {}
        self._handles = []

    def __enter__(self):
        for index, block in enumerate(self.model.blocks):
            attn = block.attn
            self._handles.append(attn.register_forward_pre_hook(self._remember(index), with_kwargs=True))
            self._handles.append(attn.qkv.register_forward_hook(self._measure(index, attn)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _remember(self, index):
        def hook(module, args, kwargs):
            if index not in self.sums:
                position_ids = args[1] if len(args) > 1 else kwargs["position_ids"]
                segments = args[2] if len(args) > 2 else kwargs.get("segments")
                self._inputs[index] = (position_ids, segments)

        return hook

    def _measure(self, index, attn):
        def hook(module, args, output):
            if index in self.sums or index not in self._inputs:
                return
            position_ids, segments = self._inputs.pop(index)
            n = self.sequences
            mixed = output[0][:, :n].transpose(0, 1).float()  # [s, b, w] -> (b, s, w)
            seg = None if segments is None else segments[:n]
            with torch.autocast(mixed.device.type, enabled=False):
                self.sums[index] = layer_sums(attn, mixed, position_ids[:n], seg).cpu()

        return hook

    def result(self) -> dict[str, list[float]] | None:
        """Per-layer lists of the three statistics; None when no forward pass ran."""
        if len(self.sums) != len(self.model.blocks):
            return None
        table = torch.stack([self.sums[i] for i in range(len(self.model.blocks))])  # (layers, 4)
        if self.model.layout.tp > 1:
            collectives.all_reduce(table, group=self.model.tp_group)
        means = table[:, :3] / table[:, 3:4]
        return {name: [round(float(v), 6) for v in means[:, c]] for c, name in enumerate(FIELDS)}
