"""The Qwen-Image 2.1 prompt template, and everything about a prompt that needs no model: its token ids with the
references' image slots, the images the vision tower reads, and the checks that refuse a prompt before any weights
move (diffusers 0.42.1 `QwenImage21Pipeline._get_qwen_prompt_embeds`; docs/checkpoints.md, "Text encoder").

- the prompt goes into a fixed chat template built as a raw string (not through a chat template), with
  `<imageN><|vision_start|><|image_pad|><|vision_end|>` per reference in the user turn, and each `<|image_pad|>`
  expanded to one token per 32x32 pixels of that reference;
- the system turn (14 tokens with the Qwen2 BPE) is dropped from the encoder's output, its length derived by
  tokenizing the system turn alone, as diffusers derives it from the rendered system message;
- a guard the reference pipeline lacks: a prompt and reference set whose DiT sequence would need RoPE positions the
  model is not defined for is refused before anything is encoded (`MAX_ROPE_POSITIONS`).

Image preprocessing uses transformers' PIL/numpy Qwen2-VL image processor, never the torchvision "fast" one.
"""

from collections.abc import Sequence

from PIL import Image

from ..vae.latents import LATENT_TOKEN_PIXELS, VLM_TOKEN_PIXELS
from .references import PreparedReference

#: The system prompt of the Qwen-Image 2.1 templates (diffusers `QwenImage21Pipeline.sys_prompt`).
SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
#: The system turn that is tokenized with the prompt and then dropped from the output.
SYSTEM_TURN = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
IMAGE_PAD = "<|image_pad|>"
#: Special tokens the templates rely on: each must be a single token of the tokenizer.
VISION_END = "<|vision_end|>"
TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", VISION_END, IMAGE_PAD)
PAD_TOKEN = "<|endoftext|>"  # Qwen's padding token, used when a tokenizer folder does not name one
#: Frame positions 0..8191 and grid positions down to -1024: the RoPE range the released DiT is defined for.
#: diffusers' `QwenImage21Rope` tabulates exactly these angles and reads a wrong row outside them, and its
#: pipeline sets no other bound on the prompt, so a longer prefix was never computed by the reference. Our
#: rope.py has no table, but the model's behaviour there is unknown. (Qwen3-VL's own 262144 positions are
#: never the tighter bound.) At 0.5 MiB of prefix cache per token in bf16, the bound also caps the prompt's
#: share of the cache at 4 GiB.
MAX_ROPE_POSITIONS = 8192
#: Characters of prompt per RoPE position read before tokenizing: real text takes 3-5 per token, so 32 never refuses
#: a prompt that fits, and bounds the tokenizer's work (a 10-million-character prompt took 50 s to be refused).
CHARS_PER_POSITION = 32
MIN_ROPE_POSITION = -1024


def image_tags(slot_counts: Sequence[int]) -> str:
    """The user turn's image prefix: `<imageN><|vision_start|>` + slots x `<|image_pad|>` + `<|vision_end|>`.

    References are separated by a single space and the prompt follows the last one with no separator, as
    the released template has it. Passing 1 per reference gives the unexpanded template.
    """
    return " ".join(
        f"<image{i}><|vision_start|>{IMAGE_PAD * count}<|vision_end|>" for i, count in enumerate(slot_counts, 1)
    )


def prompt_text(prompt: str, slot_counts: Sequence[int] = ()) -> str:
    """The full templated text for one prompt; `slot_counts` has one entry per reference (empty: text-to-image).

    An empty prompt becomes a single space: Qwen has no BOS token, and this is what the reference encodes.
    """
    prompt = prompt or " "
    return (f"{SYSTEM_TURN}<|im_start|>user\n{image_tags(slot_counts)}{prompt}<|im_end|>\n"
            "<|im_start|>assistant\n")


def rope_positions(text_tokens: int, latent_grids: Sequence[tuple[int, int]]) -> int:
    """Frame positions the DiT sequence takes: one per kept text token, `max(h, w)` per reference latent grid,
    and one for the target, which comes last (docs/checkpoints.md, "Positions in the DiT sequence")."""
    return text_tokens + sum(max(h, w) for h, w in latent_grids) + 1


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None




class PromptTokenizer:
    """The tokenizer and image processor of a Qwen3-VL text encoder, checked against its model config once.

    Args:
        tokenizer: a Qwen2 BPE tokenizer (transformers `Qwen2Tokenizer`).
        image_processor: transformers' PIL Qwen2-VL image processor (`Qwen2VLImageProcessorPil`).
        config: the text encoder's model config (`Qwen3VLConfig`): its image token ids and vision tower sizes.
        max_positions: frame positions a prompt with its references may take in the DiT sequence
            (`MAX_ROPE_POSITIONS`; tests pass a small one).
    """

    def __init__(self, tokenizer, image_processor, config, max_positions: int = MAX_ROPE_POSITIONS):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.max_positions = max_positions
        ids = {token: _single_token(tokenizer, token) for token in TEMPLATE_TOKENS}
        missing = [token for token, token_id in ids.items() if token_id is None]
        if missing:
            raise ValueError(
                f"The tokenizer does not know the special tokens {missing}: it is not a Qwen2/Qwen3 tokenizer. Use "
                "the Qwen-Image 2.1 `processor/` folder or ComfyUI's `qwen25_tokenizer`."
            )
        for token, expected in ((IMAGE_PAD, config.image_token_id), ("<|vision_start|>", config.vision_start_token_id)):
            if ids[token] != expected:
                raise ValueError(
                    f"The tokenizer maps {token} to {ids[token]} but the model expects {expected}: tokenizer and text "
                    "encoder do not belong together."
                )
        self.image_token_id = ids[IMAGE_PAD]
        self.vision_end_id = ids[VISION_END]
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _single_token(
            tokenizer, PAD_TOKEN)
        # Same derivation as diffusers: the length of the tokenized system turn (14 with the Qwen2 BPE).
        self.system_ids = list(tokenizer(SYSTEM_TURN)["input_ids"])
        self.drop_tokens = len(self.system_ids)
        vision = config.vision_config
        token_pixels = vision.patch_size * vision.spatial_merge_size
        if token_pixels != VLM_TOKEN_PIXELS:
            raise ValueError(
                f"This vision tower makes one image token per {token_pixels}x{token_pixels} pixels; Qwen-Image 2.1 "
                f"needs {VLM_TOKEN_PIXELS}x{VLM_TOKEN_PIXELS} (patch 16, merge 2) so each covers 2x2 latent tokens."
            )
        processor = (image_processor.patch_size, image_processor.merge_size, image_processor.temporal_patch_size)
        tower = (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
        if processor != tower:
            raise ValueError(
                f"Image processor patch/merge/temporal sizes {processor} do not match the vision tower's {tower}."
            )

    def vlm_image(self, reference, index: int) -> tuple[Image.Image, int]:
        """(RGB image the vision tower reads, slots its latent grid needs) for one reference."""
        if isinstance(reference, PreparedReference):
            return reference.vlm_image, reference.vlm_tokens
        if not isinstance(reference, Image.Image):
            raise TypeError(
                f"Reference {index} must be a PreparedReference or a PIL image, got {type(reference).__name__}."
            )
        width, height = reference.size
        if width % VLM_TOKEN_PIXELS or height % VLM_TOKEN_PIXELS:
            raise ValueError(
                f"Reference {index} is {width}x{height}; its sides must be multiples of {VLM_TOKEN_PIXELS} so its VLM "
                "tokens line up with its latent grid. Prepare it with references.prepare_reference()."
            )
        if reference.mode == "RGBA":  # the checkpoint saw alpha composited over white
            flat = Image.new("RGB", reference.size, (255, 255, 255))
            flat.paste(reference, mask=reference.getchannel("A"))
            reference = flat
        return reference.convert("RGB"), (width // VLM_TOKEN_PIXELS) * (height // VLM_TOKEN_PIXELS)

    def vlm_images(self, references: Sequence) -> tuple[list[Image.Image], list[int]]:
        """(RGB images the vision tower reads, image slots each one's latent grid needs), in reference order."""
        pairs = [self.vlm_image(ref, i) for i, ref in enumerate(references, 1)]
        return [image for image, _ in pairs], [slots for _, slots in pairs]

    def vision_inputs(self, images: list[Image.Image], expected: list[int]) -> dict:
        """Image-processor outputs for the references (computed once), each one's slot count checked against its
        size."""
        if not images:
            return {}
        features = self.image_processor(images=images, return_tensors="pt")
        grid = features["image_grid_thw"]
        slots = (grid.prod(-1) // self.image_processor.merge_size**2).tolist()
        size = self.image_processor.size
        for i, (image, got, want) in enumerate(zip(images, slots, expected), 1):
            if got != want:
                raise ValueError(
                    f"Reference {i} ({image.width}x{image.height}) gets {got} VLM image tokens but its latent grid "
                    f"needs {want} (one per 2x2 latent tokens): the vision processor resizes images outside "
                    f"[{size['shortest_edge']}, {size['longest_edge']}] pixels. Prepare references with "
                    "references.prepare_reference()."
                )
        return {"pixel_values": features["pixel_values"], "image_grid_thw": grid}

    def token_ids(self, prompt: str, slots: list[int]) -> list[int]:
        ids = list(self.tokenizer(prompt_text(prompt, slots))["input_ids"])
        if ids[: self.drop_tokens] != self.system_ids:
            raise ValueError("The tokenizer splits the system turn differently inside the full prompt; it is not a "
                             "Qwen2 BPE tokenizer.")
        count = sum(token == self.image_token_id for token in ids)
        if count != sum(slots):
            raise ValueError(
                f"The prompt {prompt[:60]!r} holds {count - sum(slots)} extra {IMAGE_PAD} token(s); remove special "
                "tokens from the prompt text."
            )
        return ids

    def check_positions(self, prompt: str, text_tokens: int, images: list[Image.Image]) -> None:
        """Refuse a prompt and reference set whose DiT sequence leaves the RoPE range (`MAX_ROPE_POSITIONS`)."""
        grids = [(image.height // LATENT_TOKEN_PIXELS, image.width // LATENT_TOKEN_PIXELS) for image in images]
        for i, (image, (h, w)) in enumerate(zip(images, grids), 1):
            lowest = -((max(h, w) + 1) // 2)  # a centred grid's first row / column id
            if lowest < MIN_ROPE_POSITION:
                raise ValueError(
                    f"Reference {i} is {image.width}x{image.height} pixels: its {w}x{h} latent grid needs RoPE "
                    f"positions down to {lowest}, below the {MIN_ROPE_POSITION} Qwen-Image 2.1's DiT is defined for "
                    "(the rotary table of the reference implementation, diffusers' QwenImage21Rope). Crop or shrink "
                    f"it to at most {-2 * MIN_ROPE_POSITION * LATENT_TOKEN_PIXELS} pixels per side."
                )
        needed = rope_positions(text_tokens, grids)
        if needed > self.max_positions:
            for_references = needed - 1 - text_tokens
            raise ValueError(
                f"The prompt {prompt[:40]!r}{'...' if len(prompt) > 40 else ''} is {text_tokens} tokens with its "
                "template"
                + (f", and its {len(grids)} reference(s) take {for_references} positions" if grids else "")
                + f": the DiT sequence would need {needed} RoPE positions, but Qwen-Image 2.1 is defined for at most "
                f"{self.max_positions} (positions 0..{self.max_positions - 1}: the rotary table of the reference "
                "implementation, diffusers' QwenImage21Rope; its pipeline has no other length limit). Shorten the "
                f"prompt by at least {needed - self.max_positions} tokens"
                + (" or use fewer or smaller references." if grids else ".")
            )

    def prepare(self, prompts: Sequence[str], references: Sequence) -> tuple[list, list[int], list[list[int]]]:
        """(VLM images, slots per image, token ids per prompt), every check that needs no model done."""
        limit = self.max_positions * CHARS_PER_POSITION
        for prompt in prompts:
            if len(prompt) > limit:
                raise ValueError(
                    f"The prompt {prompt[:40]!r}... is {len(prompt):,} characters; at most {limit:,} are read "
                    f"({CHARS_PER_POSITION} per RoPE position: Qwen-Image 2.1 is defined for {self.max_positions} "
                    "positions, about 35,000 characters of text). Shorten the prompt.")
        images, expected = self.vlm_images(references)
        rows = [self.token_ids(prompt, expected) for prompt in prompts]
        for prompt, row in zip(prompts, rows):
            self.check_positions(prompt, len(row) - self.drop_tokens - sum(expected), images)
        return images, expected, rows

    def check_prompt(self, prompt: str, references: Sequence = ()) -> None:
        """Raise ValueError for what `encode(prompt, references)` would refuse without running a model: image
        tokens typed into the prompt, references not sized in multiples of 32, or a sequence beyond the DiT's RoPE
        positions. Tokenizer work only, so callers can check before they move the model."""
        self.prepare([prompt], references)
