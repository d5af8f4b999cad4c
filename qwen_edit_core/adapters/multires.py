"""The multi-resolution model adapter: per-sample RoPE and a joint key mask over diffusers' transformer.

diffusers' Qwen-Image transformer uses sample 0's image shapes for the whole batch and its attention
processor refuses an external mask, so a batch of different sizes differs from one-by-one (docs/MODEL.md).
`install(transformer)` fixes that without forking diffusers or patching anything global: it swaps this model's
`pos_embed` for `PerSampleRope` (our own module) and installs `JointAttnProcessor` with `set_attn_processor`.

Batch layout: sample b's tokens are [target | control 1 | ... | padding], right-padded to the longest
sample. Its `img_shapes` entry lists its real shapes and then one padding entry `(n, 1, 1)` for its n
padding tokens (a frame count above 1 marks padding: Qwen-Image images have one frame; a single padding token
reads as a 1x1 image, which is just as harmless), so every row covers the same number of tokens (which
`zero_cond_t` models need) and padding never moves the text positions.
The processor masks padded keys (text and image); with no padding it builds no mask and calls the fused
attention kernel exactly like the stock processor. Given the batch's packed layout (`packed_layout`: the valid
text and image tokens of every sample, from lengths the host already knows), it runs variable-length attention
over the valid tokens alone instead of a padded key mask (`packed_attention`): torch's varlen kernel on a GPU,
a block-diagonal mask over the packed tokens elsewhere (the same sums as the key mask, per sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn


def is_padding(entry: Sequence[int]) -> bool:
    return int(entry[0]) != 1


class PerSampleRope(nn.Module):
    """RoPE frequencies per sample. A uniform, unpadded batch is delegated to the stock module (bit-equal);
    otherwise returns (B, S_img, D/2) image and (B, S_txt, D/2) text frequencies."""

    def __init__(self, stock: nn.Module):
        super().__init__()
        self.stock = stock
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The stock module's (pos, neg) frequency tables on `device`, copied there once and kept (they are
        plain complex tensors, not buffers, so `.to()` on the model does not move them)."""
        key = str(torch.device(device) if device is not None else self.stock.pos_freqs.device)
        if key not in self._tables:
            self._tables[key] = (self.stock.pos_freqs.to(key), self.stock.neg_freqs.to(key))
        return self._tables[key]

    def forward(self, video_fhw, device=None, max_txt_seq_len=None):
        samples = video_fhw if isinstance(video_fhw, list) and video_fhw and isinstance(video_fhw[0], list) \
            else [video_fhw if isinstance(video_fhw, list) else [video_fhw]]
        first = [tuple(e) for e in samples[0]]
        if all([tuple(e) for e in s] == first for s in samples) and not any(is_padding(e) for e in first):
            return self.stock([samples[0]], device=device, max_txt_seq_len=max_txt_seq_len)
        n_text = int(max_txt_seq_len)
        image, text = zip(*(self._sample(s, device, n_text) for s in samples))
        longest = max(f.shape[0] for f in image)
        image = [torch.cat([f, f.new_ones(longest - f.shape[0], f.shape[1])]) for f in image]
        return torch.stack(image), torch.stack(text)

    def _sample(self, shapes, device, n_text: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos, neg = self.tables(device)
        half = [d // 2 for d in self.stock.axes_dim]
        pos_t, pos_h, pos_w = pos.split(half, dim=1)
        _, neg_h, neg_w = neg.split(half, dim=1)
        parts, max_index = [], 0
        for idx, entry in enumerate(shapes):
            frames, height, width = (int(v) for v in entry)
            if is_padding(entry):
                parts.append(torch.ones(frames * height * width, pos.shape[1], dtype=pos.dtype, device=device))
                continue
            t = pos_t[idx: idx + frames].view(frames, 1, 1, -1).expand(frames, height, width, -1)
            if self.stock.scale_rope:
                # Centred positions: -h/2 .. h/2-1 (negative indices from the end of neg_freqs).
                h = torch.cat([neg_h[-(height - height // 2):], pos_h[: height // 2]])
                w = torch.cat([neg_w[-(width - width // 2):], pos_w[: width // 2]])
                max_index = max(max_index, height // 2, width // 2)
            else:
                h, w = pos_h[:height], pos_w[:width]
                max_index = max(max_index, height, width)
            h = h.view(1, height, 1, -1).expand(frames, height, width, -1)
            w = w.view(1, 1, width, -1).expand(frames, height, width, -1)
            parts.append(torch.cat([t, h, w], dim=-1).reshape(frames * height * width, -1))
        return torch.cat(parts), pos[max_index: max_index + n_text]


def _rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate (B, S, H, D) by complex frequencies (S, D/2) (shared) or (B, S, D/2) (per sample).

    The complex product (a + ib)(cos + i sin) written out in real float32 arithmetic: the same numbers as
    diffusers' complex multiply up to rounding, and a compiled block fuses it with the q/k norms (inductor
    generates no code for complex tensors and falls back to separate eager kernels for them)."""
    freqs = torch.view_as_real(freqs)  # (..., D/2, 2): cos, sin
    freqs = freqs.unsqueeze(1) if freqs.dim() == 3 else freqs.unsqueeze(2)
    cos, sin = freqs[..., 0], freqs[..., 1]
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(3).type_as(x)


class JointAttnProcessor:
    """Qwen's joint text+image attention with per-sample RoPE and a key mask over padded text and image
    tokens. `calls` counts which path ran ("fused": no mask; "masked") in eager (uncompiled) calls."""

    def __init__(self) -> None:
        self.calls = {"fused": 0, "masked": 0, "packed": 0}

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None, image_mask=None, varlen_index=None,
                 varlen_offsets=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        if attention_mask is not None:
            raise ValueError("JointAttnProcessor takes encoder_hidden_states_mask and image_mask, not attention_mask")
        head_dim = attn.inner_dim // attn.heads
        img = [proj(hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v)]
        txt = [proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
               for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        if attn.norm_q is not None:
            img[0] = attn.norm_q(img[0])
        if attn.norm_k is not None:
            img[1] = attn.norm_k(img[1])
        if attn.norm_added_q is not None:
            txt[0] = attn.norm_added_q(txt[0])
        if attn.norm_added_k is not None:
            txt[1] = attn.norm_added_k(txt[1])
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img[0], img[1] = _rope(img[0], img_freqs), _rope(img[1], img_freqs)
            txt[0], txt[1] = _rope(txt[0], txt_freqs), _rope(txt[1], txt_freqs)
        query, key, value = (torch.cat([t, i], dim=1) for t, i in zip(txt, img))
        mask = None
        if varlen_index is None:
            mask = joint_key_mask(encoder_hidden_states_mask, image_mask, encoder_hidden_states.shape[:2],
                                  hidden_states.shape[:2], hidden_states.device)
        if not torch.compiler.is_compiling():
            # Counted in eager runs only: in a compiled block the count would be a guard that changes on every
            # call, recompiling the block each time until dynamo's recompile limit fails the fullgraph compile.
            self.calls["packed" if varlen_index is not None else "fused" if mask is None else "masked"] += 1
        if varlen_index is not None:
            out = packed_attention(query, key, value, varlen_index, varlen_offsets)
        else:
            out = dispatch_attention_fn(query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False)
        out = out.flatten(2, 3).to(query.dtype)
        n_text = encoder_hidden_states.shape[1]
        img_out = attn.to_out[0](out[:, n_text:].contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(out[:, :n_text].contiguous())


def joint_key_mask(text_mask, image_mask, text_shape, image_shape, device) -> torch.Tensor | None:
    """(B, 1, 1, S_text + S_image) boolean key mask, or None when nothing is padded."""
    if text_mask is None and image_mask is None:
        return None
    text = text_mask.bool() if text_mask is not None else torch.ones(text_shape, dtype=torch.bool, device=device)
    image = image_mask.bool() if image_mask is not None else torch.ones(image_shape, dtype=torch.bool, device=device)
    return torch.cat([text, image], dim=1)[:, None, None, :]


def packed_layout(text_lengths: Sequence[int], text_len: int, image_lengths: Sequence[int], image_len: int,
                  device) -> dict | None:
    """The attention kwargs of a batch whose samples have different lengths: `varlen_index` (T,) the positions of
    every sample's valid tokens in the flattened (B * (text_len + image_len)) joint [text | image] layout, and
    `varlen_offsets` (B + 1,) int32 where each sample's run of them starts (the cumulative lengths varlen kernels
    take). Built from host-side lengths (`PromptEmbeds.lengths`, the image rows' token counts): no device read.
    None when nothing is padded (one fused call, no mask)."""
    if all(n == text_len for n in text_lengths) and all(n == image_len for n in image_lengths):
        return None
    joint, runs = text_len + image_len, []
    for b, (n_text, n_image) in enumerate(zip(text_lengths, image_lengths)):
        runs += [torch.arange(n_text) + b * joint, torch.arange(n_image) + b * joint + text_len]
    offsets = [0]
    for n_text, n_image in zip(text_lengths, image_lengths):
        offsets.append(offsets[-1] + n_text + n_image)
    return {"varlen_index": torch.cat(runs).to(device),
            "varlen_offsets": torch.tensor(offsets, dtype=torch.int32).to(device)}


def image_lengths(img_shapes: Sequence[Sequence[Sequence[int]]]) -> list[int]:
    """Each row's real image tokens (its padding entry left out: see the module doc), from host-side shapes."""
    return [sum(int(f) * int(h) * int(w) for f, h, w in shapes if not is_padding((f, h, w))) for shapes in img_shapes]


def _varlen_kernel(query: torch.Tensor) -> bool:
    """Whether torch's varlen flash kernel takes these packed tokens (CUDA, half precision, torch >= 2.9)."""
    if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return True


def packed_attention(query, key, value, index: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Attention over each sample's valid tokens alone: (B, S, H, D) inputs gathered at `index` into (T, H, D),
    one variable-length call (`offsets`: where each sample starts), scattered back; padded positions get zeros
    (nothing reads them: every key mask of the padded layout leaves them out). On a GPU in half precision
    torch's varlen kernel (`torch.nn.attention.varlen.varlen_attn`, cuDNN or flash underneath); elsewhere one
    SDPA call over the packed tokens with a block-diagonal mask (each sample's tokens see their own sample's)."""
    b, s, heads, dim = query.shape
    q, k, v = (x.reshape(b * s, heads, dim).index_select(0, index) for x in (query, key, value))
    if _varlen_kernel(q):
        from torch.nn.attention.varlen import varlen_attn
        out = varlen_attn(q, k, v, offsets, offsets, s, s)  # s bounds every sample's length
    else:
        sample = torch.searchsorted(offsets[1:], torch.arange(q.shape[0], device=q.device, dtype=offsets.dtype),
                                    right=True)
        mask = (sample[:, None] == sample[None, :])[None, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=mask)[0].transpose(0, 1)
    return out.new_zeros(b * s, heads, dim).index_copy(0, index, out).reshape(b, s, heads, dim)


def install(transformer) -> JointAttnProcessor | None:
    """Make `transformer` batch mixed resolutions exactly; idempotent. Returns the installed processor; None for a
    transformer whose family does not pad mixed sizes into one call (`Family.padded_batches`), left as it is."""
    from qwen_edit_core.families import family_of
    if not family_of(transformer).padded_batches:
        return None
    if not isinstance(transformer.pos_embed, PerSampleRope):
        transformer.pos_embed = PerSampleRope(transformer.pos_embed)
    processor = JointAttnProcessor()
    transformer.set_attn_processor(processor)
    return processor


@dataclass(frozen=True)
class PackedBatch:
    """Model input of a (possibly ragged) batch; `image_mask` is None when nothing is padded."""

    hidden: torch.Tensor                      # (B, N_max, C)
    image_mask: torch.Tensor | None           # (B, N_max) bool
    img_shapes: list[list[tuple[int, int, int]]]
    n_target: list[int]

    @property
    def attention_kwargs(self) -> dict | None:
        """The key mask of padded image tokens (the masked path; `packed_kwargs` gives the packed one)."""
        return None if self.image_mask is None else {"image_mask": self.image_mask}

    def packed_kwargs(self, text_lengths: Sequence[int], text_len: int) -> dict | None:
        """The attention kwargs with prompts of `text_lengths` padded to `text_len`: variable-length attention over
        the valid tokens (`packed_layout`), or None when no token of text or image is padded."""
        return packed_layout(text_lengths, text_len, image_lengths(self.img_shapes), self.hidden.shape[1],
                             self.hidden.device)

    def padding_fraction(self) -> float:
        if self.image_mask is None:
            return 0.0
        return 1.0 - float(self.image_mask.float().mean())


def pack_samples(targets: Sequence[torch.Tensor], controls: Sequence[torch.Tensor],
                 shapes: Sequence[Sequence[tuple[int, int, int]]]) -> PackedBatch:
    """Concatenate each sample's [target | controls] tokens and right-pad the batch (see module doc)."""
    rows = [torch.cat([t, c], dim=0) for t, c in zip(targets, controls)]
    longest = max(r.shape[0] for r in rows)
    if all(r.shape[0] == longest for r in rows) and all(list(s) == list(shapes[0]) for s in shapes):
        return PackedBatch(torch.stack(rows), None, [list(map(tuple, s)) for s in shapes],
                           [t.shape[0] for t in targets])
    hidden = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
    mask = torch.zeros(len(rows), longest, dtype=torch.bool, device=hidden.device)
    padded_shapes = []
    for b, (row, s) in enumerate(zip(rows, shapes)):
        mask[b, : row.shape[0]] = True
        pad = longest - row.shape[0]
        padded_shapes.append(list(map(tuple, s)) + ([(pad, 1, 1)] if pad else []))
    return PackedBatch(hidden, mask, padded_shapes, [t.shape[0] for t in targets])
