"""Where each model component lives: a validated device plan.

A plan names a device and a dtype per component. It is checked before any weight is loaded, so a typo in
"cuda:3" fails in a millisecond with the list of devices that exist, not after a 40 GB load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

COMPONENTS = ("text_encoder", "vae", "transformer")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


class DeviceError(ValueError):
    """A device or dtype that cannot be used; the message names the component and what exists."""


def available_devices() -> list[str]:
    """Devices this process can use, in the order a device picker should list them."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return found


def resolve_device(name: str, *, component: str = "device") -> torch.device:
    """Parse and check one device string; "cuda" means "cuda:0". Raises DeviceError naming `component`."""
    text = str(name).strip().lower()
    if text == "cuda":
        text = "cuda:0"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise DeviceError(f"{component}: {name!r} is not a device name; available: {', '.join(available_devices())}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    canonical = str(device)
    if canonical not in available_devices():
        why = " (this machine has no CUDA device)" if device.type == "cuda" and not torch.cuda.is_available() else ""
        raise DeviceError(f"{component}: device {name!r} does not exist{why}; "
                          f"available: {', '.join(available_devices())}")
    return device


def resolve_dtype(name: str | torch.dtype, *, component: str = "dtype") -> torch.dtype:
    """Map "bf16"/"bfloat16"/torch.bfloat16 (and fp16, fp32) to a torch dtype."""
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        raise DeviceError(f"{component}: dtype {name} is not supported; accepted: float32, bfloat16, float16")
    try:
        return DTYPES[str(name).strip().lower()]
    except KeyError:
        raise DeviceError(f"{component}: dtype {name!r} is not supported; accepted: {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class DevicePlan:
    """Device and dtype of each component. Build it with `DevicePlan.from_mapping`, which validates."""

    text_encoder: torch.device = field(default_factory=lambda: torch.device("cpu"))
    vae: torch.device = field(default_factory=lambda: torch.device("cpu"))
    transformer: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    #: Second transformer device for `split` CFG (the uncond branch runs there on its own replica).
    transformer_uncond: torch.device | None = None

    @classmethod
    def from_mapping(cls, devices: dict[str, str] | None = None, dtype: str | torch.dtype = "float32",
                     transformer_uncond: str | None = None) -> "DevicePlan":
        """Validate {"text_encoder": "cuda:1", "vae": "cpu", "transformer": "cuda:0"}; missing keys mean cpu."""
        devices = dict(devices or {})
        unknown = sorted(set(devices) - set(COMPONENTS))
        if unknown:
            raise DeviceError(f"unknown component(s) {unknown} in device plan; accepted: {', '.join(COMPONENTS)}")
        resolved = {c: resolve_device(devices.get(c) or "cpu", component=c) for c in COMPONENTS}
        uncond = resolve_device(transformer_uncond, component="transformer_uncond") if transformer_uncond else None
        return cls(**resolved, dtype=resolve_dtype(dtype), transformer_uncond=uncond)

    @classmethod
    def parse(cls, text: str, dtype: str = "float32") -> "DevicePlan":
        """Parse the CLI form "text_encoder=cpu,vae=cpu,transformer=cuda:0"."""
        pairs = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise DeviceError(f"device plan entry {part!r} must look like component=device, "
                                  f"e.g. transformer=cuda:0")
            key, value = part.split("=", 1)
            pairs[key.strip()] = value.strip()
        return cls.from_mapping(pairs, dtype=dtype)

    def as_dict(self) -> dict[str, str]:
        return {c: str(getattr(self, c)) for c in COMPONENTS}
