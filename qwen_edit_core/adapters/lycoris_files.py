"""LoKr, LoHa and DoRA in LoRA files: the in-memory layers, their weight change as stock ComfyUI computes it, and
the tensors we write for peft's LoKr / LoHa / DoRA adapters.

Keys (after the module prefix `diffusion_model.P.`), as stock ComfyUI's weight adapters read them (ComfyUI commit
a125cd84b054a57729b5eecab930ca9408719832, comfy/lora.py `load_lora`, comfy/weight_adapter/lokr.py, loha.py,
lora.py, base.py `weight_decompose`):
- LoKr: `lokr_w1` (or its factors `lokr_w1_a` @ `lokr_w1_b`), `lokr_w2` (or `lokr_w2_a` @ `lokr_w2_b`),
  optional `alpha`. delta W = scale * kron(w1, w2), where scale = alpha / dim only when a factor is stored
  low-rank (dim = the rank of w2's factors, else of w1's) and an alpha is present; full factors use scale 1.
- LoHa: `hada_w1_a`, `hada_w1_b`, `hada_w2_a`, `hada_w2_b`, optional `alpha`:
  delta W = alpha / dim * (w1_a @ w1_b) * (w2_a @ w2_b) (elementwise), dim = hada_w1_b's rows.
- DoRA: a LoRA plus `dora_scale`. With dora_scale of shape (out, 1) ComfyUI patches
  W' = dora_scale / (||W||_row + eps) * (W + alpha / rank * up @ down): the norm is the ORIGINAL weight's, per
  output row, eps = torch.finfo(float32).eps (ComfyUI patches a float32 copy of the weight). At strength s it
  applies W + s * (W' - W). peft's DoRA applies m / ||W + scale * B @ A||_row * (W + scale * B @ A) instead, so
  we save dora_scale = m * (||W||_row + eps) / ||W + scale * B @ A||_row (`dora_scale_for`), which makes
  ComfyUI's formula give peft's weight exactly (up to float rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: ComfyUI's eps in `weight_decompose`: finfo of the weight it patches (a float32 copy)
DORA_EPS = torch.finfo(torch.float32).eps
LOKR_KEYS = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b")
LOHA_KEYS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
#: keys of convolution-only variants (Tucker cores), refused: every layer we adapt is a Linear
CONV_ONLY_KEYS = ("lokr_t2", "hada_t1", "hada_t2")


def _mat(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().cpu()


@dataclass(frozen=True)
class LokrLayer:
    """One module's LoKr as a file holds it (factors float32 on the CPU; a full factor or its two low-rank ones)."""
    w1: torch.Tensor | None
    w2: torch.Tensor | None
    w1_a: torch.Tensor | None
    w1_b: torch.Tensor | None
    w2_a: torch.Tensor | None
    w2_b: torch.Tensor | None
    alpha: float | None
    kind = "lokr"

    @property
    def dim(self) -> int | None:
        """ComfyUI's `dim`: the rank of w2's factors, else of w1's; None when both factors are full."""
        if self.w2_b is not None:
            return self.w2_b.shape[0]
        return None if self.w1_b is None else self.w1_b.shape[0]

    @property
    def rank(self) -> int:
        return self.dim or 1

    @property
    def scale(self) -> float:
        """alpha / dim when a factor is low-rank and the file has an alpha, else 1.0 (ComfyUI's rule)."""
        return self.alpha / self.dim if self.alpha is not None and self.dim is not None else 1.0

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1, w2) as full matrices."""
        w1 = self.w1 if self.w1 is not None else self.w1_a @ self.w1_b
        w2 = self.w2 if self.w2 is not None else self.w2_a @ self.w2_b
        return w1, w2

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in) of the weight the layer changes."""
        (a, c), (b, d) = (tuple(f.shape) for f in self.factors())
        return a * b, c * d

    def delta(self) -> torch.Tensor:
        return self.scale * torch.kron(*self.factors())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k[len("lokr_"):]) for k in LOKR_KEYS if getattr(self, k[len("lokr_"):]) is not None}


@dataclass(frozen=True)
class LohaLayer:
    """One module's LoHa as a file holds it: delta W = scale * (w1_a @ w1_b) * (w2_a @ w2_b)."""
    w1_a: torch.Tensor
    w1_b: torch.Tensor
    w2_a: torch.Tensor
    w2_b: torch.Tensor
    alpha: float | None
    kind = "loha"

    @property
    def rank(self) -> int:
        return self.w1_b.shape[0]

    @property
    def scale(self) -> float:
        return 1.0 if self.alpha is None else self.alpha / self.rank

    @property
    def shape(self) -> tuple[int, int]:
        return self.w1_a.shape[0], self.w1_b.shape[1]

    def delta(self) -> torch.Tensor:
        return self.scale * (self.w1_a @ self.w1_b) * (self.w2_a @ self.w2_b)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k[len("hada_"):]) for k in LOHA_KEYS}


def lycoris_layer(tensors: dict[str, torch.Tensor], keys: dict[str, str], alpha: float | None, module: str,
                  source: str) -> LokrLayer | LohaLayer:
    """A LoKr or LoHa layer from a module's keys ({"lokr_w1": file key, ...}); shapes are checked."""
    conv = [keys[k] for k in CONV_ONLY_KEYS if k in keys]
    if conv:
        raise ValueError(f"{source}: {conv[0]!r} is a convolution (Tucker) factor; module {module!r} is a Linear")
    get = {k: _mat(tensors[v]) for k, v in keys.items()}
    if any(k in keys for k in LOHA_KEYS):
        missing = [k for k in LOHA_KEYS if k not in keys]
        if missing:
            raise ValueError(f"{source}: LoHa module {module!r} lacks {missing}")
        layer = LohaLayer(get["hada_w1_a"], get["hada_w1_b"], get["hada_w2_a"], get["hada_w2_b"], alpha)
        ok = (layer.w1_a.shape == layer.w2_a.shape and layer.w1_b.shape == layer.w2_b.shape
              and layer.w1_a.shape[1] == layer.w1_b.shape[0] and layer.w2_b.shape[0] == layer.w2_a.shape[1])
    else:
        for n in ("1", "2"):
            if f"lokr_w{n}" not in keys and not {f"lokr_w{n}_a", f"lokr_w{n}_b"} <= set(keys):
                raise ValueError(f"{source}: LoKr module {module!r} has neither lokr_w{n} nor both lokr_w{n}_a and "
                                 f"lokr_w{n}_b")
        layer = LokrLayer(*(get.get(k) for k in LOKR_KEYS), alpha)
        ok = all(a.shape[1] == b.shape[0] for a, b in ((layer.w1_a, layer.w1_b), (layer.w2_a, layer.w2_b))
                 if a is not None and b is not None)
    if not ok:
        raise ValueError(f"{source}: the {layer.kind} factors of module {module!r} do not fit together: "
                         + ", ".join(f"{k} {tuple(v.shape)}" for k, v in layer.tensors().items()))
    return layer


# -- ComfyUI's DoRA rule ---------------------------------------------------------------------------------------
def row_norm(weight: torch.Tensor) -> torch.Tensor:
    """Per output row L2 norm, float32, shape (out, 1)."""
    return weight.float().norm(dim=1, keepdim=True)


def dora_weight(base: torch.Tensor, delta: torch.Tensor, dora_scale: torch.Tensor,
                strength: float = 1.0) -> torch.Tensor:
    """The weight stock ComfyUI patches from a DoRA layer (dora_scale (out, 1)): W + s * (W' - W) with
    W' = dora_scale / (||W||_row + eps) * (W + delta); float32."""
    base = base.float()
    patched = dora_scale.float().reshape(-1, 1) / (row_norm(base) + DORA_EPS) * (base + delta.float())
    return base + strength * (patched - base)


def dora_scale_for(base: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """The dora_scale (out, 1) that makes `dora_weight(base, delta, ·)` equal peft's
    magnitude / ||W + delta||_row * (W + delta)."""
    base = base.float()
    return magnitude.float().reshape(-1, 1) * (row_norm(base) + DORA_EPS) / row_norm(base + delta.float())


def peft_dora_from(base: torch.Tensor, down: torch.Tensor, up: torch.Tensor, scale: float, dora_scale: torch.Tensor,
                   strength: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, magnitude) of a peft DoRA adapter with scaling 1 and A = `down` whose weight equals ComfyUI's DoRA patch
    at `strength`: W + s (c (W + scale up@down) - W) = g (W + k * up@down) per row, with c = dora_scale /
    (||W|| + eps), g = 1 - s + s c and k = s c scale / g; so B = k * up and magnitude = g * ||W + B @ A||."""
    base = base.float()  # the file's tensors join it on its device (a file is read into host memory)
    down, up, dora_scale = (t.to(base.device) for t in (down, up, dora_scale))
    c = dora_scale.float().reshape(-1, 1) / (row_norm(base) + DORA_EPS)
    g = 1.0 - strength + strength * c
    if bool((g.abs() < 1e-6).any()):
        raise ValueError(f"DoRA at strength {strength}: the patched weight of some rows is zero; use another "
                         "strength")
    up_new = (strength * c * scale / g) * up.float()
    magnitude = (g * row_norm(base + up_new @ down.float())).reshape(-1)
    return up_new, magnitude
