"""Optional: ask the model's own vision-language text encoder (Qwen2.5-VL, a `model.components.TextEncoder` the
caller has already loaded: nothing is loaded or downloaded here) whether each pair's target shows its caption's edit
applied to its control, and what edit it sees (a caption proposal). A "no" is a `caption` finding with the model's
own description as the proposed caption; an answer that is neither yes nor no is counted in the note (how many
pairs it judged and how), never guessed. A pair with no caption gets the model's description as a machine-proposed
caption, which `--fix` writes into the fixed copy.
"""

from __future__ import annotations

from typing import Optional, Sequence

from PIL import Image

from qwen_edit_core.data.doctor.findings import PROPOSED_CAPTION, CheckResult, Finding
from qwen_edit_core.data.doctor.pictures import full_rgb
from qwen_edit_core.families.templates import EDIT_PLUS_IMAGE_PREFIX

#: Qwen2.5-VL's chat turn (what its processor's chat template writes for one user message)
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTION = ("Picture 1 is the original and picture 2 the edited result. Does picture 2 show this edit applied to "
            "picture 1: \"{}\"? Answer yes or no.")
DESCRIBE = ("Picture 1 is the original and picture 2 the edited result. Say in one short sentence, as an "
            "instruction, what edit turns picture 1 into picture 2.")
#: the longest side the pictures are shown at (vision tokens grow with the area)
SIDE = 384


def _shown(image: Image.Image, side: int = SIDE) -> Image.Image:
    """`image` no larger than `side` on its longest side."""
    image = image.copy()
    image.thumbnail((side, side), Image.BICUBIC)
    return image


def ask(text_encoder, images: Sequence[Image.Image], question: str, max_new_tokens: int = 32) -> str:
    """The text encoder's greedy answer to `question` about `images` (shown as "Picture 1: ...", as the Edit Plus
    template numbers them), special tokens removed."""
    import torch
    prompt = CHAT.format("".join(EDIT_PLUS_IMAGE_PREFIX.format(k + 1) for k in range(len(images))) + question)
    inputs = text_encoder.processor(text=[prompt], images=[_shown(i) for i in images], return_tensors="pt")
    inputs = inputs.to(text_encoder.device)
    with torch.inference_mode():
        out = text_encoder.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    answer = text_encoder.processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return answer[0].strip()


def verdict(answer: str) -> Optional[bool]:
    """True for an answer starting with yes, False for no, None for anything else."""
    words = answer.strip().lower().split()
    first = words[0].strip(".,!:;\"'") if words else ""
    return {"yes": True, "no": False}.get(first)


def describe(text_encoder, control: Image.Image, target: Image.Image) -> str:
    """The edit the text encoder sees from `control` to `target`, as a caption proposal."""
    return ask(text_encoder, (control, target), DESCRIBE)


def _uncaptioned(name: str, source: int, proposal: str) -> Finding:
    """The caption finding of a pair with no caption: the text encoder's `proposal` as the fix `--fix` applies."""
    fix = PROPOSED_CAPTION + proposal if proposal else None
    return Finding(name, "caption", proposal or None, fix,
                   f"it has no caption; the text encoder, shown control {source + 1} and the target, proposes "
                   f"{proposal!r} (machine-proposed: read it before training on it)", severity=0.7)


def check(pairs, text_encoder) -> CheckResult:
    """Ask about every pair of `pairs` (`findings.Measured`, their `measures.source` the edited control): a caption
    finding for each "no", with the model's description of the edit as the fix; a note counts the answers. A pair
    with no caption (empty: the dataset reader keeps them for this check) is described instead, its description the
    caption `--fix` writes."""
    result = CheckResult()
    unclear, yes = [], 0
    described = [p for p in pairs if not p.example.caption]
    for pair in described:
        control, target = full_rgb(pair.example.controls[pair.measures.source]), full_rgb(pair.example.target)
        proposal = describe(text_encoder, control, target)
        result.findings.append(_uncaptioned(pair.name, pair.measures.source, proposal))
    if described:
        result.notes.append(f"vision-language check: {len(described)} pair(s) without a caption described "
                            f"(first: {described[0].name}; proposals in their caption findings)")
    pairs = [p for p in pairs if p.example.caption]
    for pair in pairs:
        example, source = pair.example, pair.measures.source
        control, target = full_rgb(example.controls[source]), full_rgb(example.target)
        answer = ask(text_encoder, (control, target), QUESTION.format(example.caption), max_new_tokens=4)
        said = verdict(answer)
        yes += said is True
        if said is None:
            unclear.append(pair.name)
        elif not said:
            proposal = describe(text_encoder, control, target)
            fix = f"recaption as {proposal!r} (not applied by --fix)" if proposal else None
            result.findings.append(Finding(
                pair.name, "caption", answer, fix,
                f"the text encoder answers {answer!r} when asked whether the target shows {example.caption!r} "
                f"applied to control {source + 1}", severity=0.4))
    first = f" (first: {unclear[0]}; not judged)" if unclear else ""
    result.notes.append(f"vision-language check: {len(pairs)} pair(s) asked, {yes} yes, "
                        f"{len(pairs) - yes - len(unclear)} no, {len(unclear)} neither{first}")
    return result
