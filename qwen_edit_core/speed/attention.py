"""Which fused scaled-dot-product attention kernel runs first."""

from __future__ import annotations

#: `train.attention` / `predict.attention` values: which fused SDPA kernel runs first. "auto" is torch's own
#: order (flash, then memory-efficient, then cuDNN on most builds); "cudnn" puts cuDNN's kernel first, which
#: on Hopper is the fastest for Qwen's 24 heads x 128 dims (docs/MODEL.md: attention is ~1/3 of a 1 MP step).
ATTENTION_KERNELS = ("auto", "cudnn", "flash", "efficient", "math")


def check_attention_kernel(name: str) -> None:
    if name not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {name!r} is not accepted; accepted: {', '.join(ATTENTION_KERNELS)}")


def attention_kernel(name: str):
    """A context manager under which `F.scaled_dot_product_attention` prefers kernel `name`, falling back to
    the others when it cannot run the call (CPU, a mask the kernel rejects). torch's SDPA backend flags are
    set for the duration of the block and restored on exit (`torch.nn.attention.sdpa_kernel`).

    Wrap the forward and the backward pass of a step: a checkpointed block's recompute runs in the backward.
    """
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel
    check_attention_kernel(name)
    if name == "auto":
        return contextlib.nullcontext()
    order = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    first = order.pop(name)
    return sdpa_kernel([first, *order.values()], set_priority=True)
