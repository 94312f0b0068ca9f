"""The Qwen-Image 2.1 text encoder: Qwen3-VL-8B reading the prompt and the references together.

The language model and vision tower are transformers' own (`Qwen3VLModel`, the body of
`Qwen3VLForConditionalGeneration` without its LM head, which conditioning never uses); this module only
builds their inputs and picks their outputs the way the reference pipeline does (diffusers 0.42.1
`QwenImage21Pipeline._get_qwen_prompt_embeds`; the template and the token accounting are in
docs/checkpoints.md, "Text encoder"):

- the prompt goes into a fixed chat template built as a raw string (not through a chat template), with
  `<imageN><|vision_start|><|image_pad|><|vision_end|>` per reference in the user turn, and each `<|image_pad|>`
  expanded to one token per 32x32 pixels of that reference;
- prompts of a batch are left-padded, as the checkpoint was trained;
- the output is the LAST decoder layer's hidden state BEFORE the final RMSNorm. The model is built with that
  norm replaced by an identity, so `last_hidden_state` is exactly that state (diffusers hooks the norm to an
  identity for the same reason: transformers >= 5 returns the normed state in `hidden_states[-1]`);
- padding is removed and the system turn (14 tokens with the Qwen2 BPE) is dropped, its length derived by
  tokenizing the system turn alone, as diffusers derives it from the rendered system message;
- `image_slots` marks the `<|image_pad|>` positions that remain: the DiT puts 2x2 latent tokens of the
  matching reference at each one.

Two guards the reference pipeline lacks: a prompt and reference set whose DiT sequence would need RoPE
positions the model is not defined for is refused before anything is encoded (`MAX_ROPE_POSITIONS`), and
`interruptible` lets a caller stop an encoding between layers.

Loading from files lives in `loaders/text_encoder.py`. Image preprocessing uses transformers' PIL/numpy
Qwen2-VL image processor, never the torchvision "fast" one.
"""

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from PIL import Image
from torch import nn
from transformers import DynamicCache

from .latents import LATENT_TOKEN_PIXELS, VLM_TOKEN_PIXELS
from .references import PreparedReference
from .text_encoder_cache import LeadingRun, PromptCache, VisionOutput, image_key, run_key

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


@dataclass(frozen=True, eq=False)
class EncodedPrompt:
    """One prompt's conditioning, padding and system turn removed.

    Attributes:
        embeds: `(L, hidden)` last-decoder-layer states before the final norm, in the model's dtype and device.
        image_slots: `(L,)` bool, True at the `<|image_pad|>` positions (one per 2x2 latent tokens).
        token_ids: `(L,)` int64, the kept token ids (for inspection and cache keys).
    """

    embeds: torch.Tensor
    image_slots: torch.Tensor
    token_ids: torch.Tensor


@dataclass(frozen=True, eq=False)
class EncodedBatch:
    """Several prompts encoded together (left-padded inside the encoder), as diffusers' `_get_qwen_prompt_embeds`
    returns them.

    Attributes:
        prompts: each prompt on its own, exactly as `encode` returns it.
        embeds: `(B, L_max, hidden)` right-padded with zeros.
        prompt_mask: `(B, L_max)` bool, True at real tokens. diffusers holds the same values as int64, and
            `encode_prompt` turns an all-True mask into None.
        image_slots: `(B, L_max)` bool, False on the padding.
    """

    prompts: tuple[EncodedPrompt, ...]
    embeds: torch.Tensor
    prompt_mask: torch.Tensor
    image_slots: torch.Tensor


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


class _VisionBatch:
    """Vision-tower outputs in the form transformers' `mm_encoder_outputs` takes: per-image merged tokens and, per
    DeepStack layer, per-image features."""

    def __init__(self, pooler_output, deepstack_features):
        self.pooler_output, self.deepstack_features = tuple(pooler_output), [tuple(f) for f in deepstack_features]


def _batch(encoded: list) -> "EncodedBatch":
    embeds = _right_pad([e.embeds for e in encoded])
    prompt_mask = _right_pad([torch.ones_like(e.image_slots) for e in encoded])
    image_slots = _right_pad([e.image_slots for e in encoded])
    return EncodedBatch(prompts=tuple(encoded), embeds=embeds, prompt_mask=prompt_mask, image_slots=image_slots)


def _right_pad(rows: list[torch.Tensor]) -> torch.Tensor:
    length = max(row.shape[0] for row in rows)
    out = rows[0].new_zeros((len(rows), length) + tuple(rows[0].shape[1:]))
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
    return out


class QwenImageTextEncoder:
    """Qwen3-VL with its tokenizer and image processor, producing Qwen-Image 2.1 prompt conditioning.

    Args:
        model: a transformers `Qwen3VLModel` whose `language_model.norm` is an identity (see the module
            docstring); `loaders.text_encoder.load_text_encoder` builds one from files.
        tokenizer: a Qwen2 BPE tokenizer (transformers `Qwen2Tokenizer`).
        image_processor: transformers' PIL Qwen2-VL image processor (`Qwen2VLImageProcessorPil`).
        source: free-form description of where the weights came from, for reports.
        max_positions: frame positions a prompt with its references may take in the DiT sequence
            (`MAX_ROPE_POSITIONS`; tests pass a small one).

    Attributes:
        preferred_device: where encoding should run; None lets the caller pick (the ComfyUI node: its compute
            device). The text-encoder loader node sets it from its `device` input.
    """

    def __init__(self, model: nn.Module, tokenizer, image_processor, source: str = "",
                 max_positions: int = MAX_ROPE_POSITIONS):
        if not isinstance(model.language_model.norm, nn.Identity):
            raise ValueError(
                "QwenImageTextEncoder needs the language model's final norm replaced by nn.Identity(): Qwen-Image "
                "reads the last decoder layer's output before that norm."
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.source = source
        self.max_positions = max_positions
        self.preferred_device: torch.device | None = None
        config = model.config
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
        #: vision outputs and the leading run's keys/values kept between encodings (text_encoder_cache.py);
        #: `prompt_cache.budget_bytes = 0` turns reuse off
        self.prompt_cache = PromptCache()
        self.last_reused_tokens = 0  # leading tokens the last encoding took from `prompt_cache`
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

    @property
    def device(self) -> torch.device:
        return self.model.language_model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.language_model.embed_tokens.weight.dtype

    @property
    def hidden_size(self) -> int:
        return self.model.config.text_config.hidden_size

    def to(self, device) -> "QwenImageTextEncoder":
        """Move the weights (e.g. offload to the CPU after encoding); returns self."""
        self.model.to(device)
        return self

    # -- inputs ------------------------------------------------------------------------------------------------
    def _vlm_image(self, reference, index: int) -> tuple[Image.Image, int]:
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

    def _vlm_images(self, references: Sequence) -> tuple[list[Image.Image], list[int]]:
        """(RGB images the vision tower reads, image slots each one's latent grid needs), in reference order."""
        pairs = [self._vlm_image(ref, i) for i, ref in enumerate(references, 1)]
        return [image for image, _ in pairs], [slots for _, slots in pairs]

    def _vision_inputs(self, images: list[Image.Image], expected: list[int]) -> dict:
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

    def _token_ids(self, prompt: str, slots: list[int]) -> list[int]:
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

    def _check_positions(self, prompt: str, text_tokens: int, images: list[Image.Image]) -> None:
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

    def _prepare(self, prompts: Sequence[str], references: Sequence) -> tuple[list, list[int], list[list[int]]]:
        """(VLM images, slots per image, token ids per prompt), every check that needs no model done."""
        images, expected = self._vlm_images(references)
        rows = [self._token_ids(prompt, expected) for prompt in prompts]
        for prompt, row in zip(prompts, rows):
            self._check_positions(prompt, len(row) - self.drop_tokens - sum(expected), images)
        return images, expected, rows

    def check_prompt(self, prompt: str, references: Sequence = ()) -> None:
        """Raise ValueError for what `encode(prompt, references)` would refuse without running a model: image
        tokens typed into the prompt, references not sized in multiples of 32, or a sequence beyond the DiT's RoPE
        positions. Tokenizer work only, so callers can check before they move the model."""
        self._prepare([prompt], references)

    @contextmanager
    def interruptible(self, check: Callable[[], None] | None) -> Iterator[None]:
        """Within the block, `check()` runs before every decoder layer and vision block; it stops an encoding by
        raising (ComfyUI's interrupt exception, say). With None nothing changes.

        Forward pre-hooks leave transformers' model code as it is, and they are removed on exit, also when
        `check` raised.
        """
        if check is None:
            yield
            return
        layers = [*self.model.visual.blocks, *self.model.language_model.layers]
        handles = [layer.register_forward_pre_hook(lambda module, args: check()) for layer in layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    # -- encoding ----------------------------------------------------------------------------------------------
    @torch.no_grad()  # not inference_mode: callers may update the outputs in place
    def encode_batch(self, prompts: Sequence[str], references: Sequence = ()) -> EncodedBatch:
        """Encode several prompts that share the same references (as the reference pipeline does).

        Args:
            prompts: prompt strings; an empty one is encoded as a single space.
            references: `PreparedReference`s (or x32-sized PIL images) in `<image1>`..`<imageN>` order.
        """
        if isinstance(prompts, str) or not prompts:
            raise ValueError("encode_batch takes a non-empty list of prompts; use encode() for one.")
        device = self.device
        images, expected, rows = self._prepare(prompts, references)
        self.last_reused_tokens = 0
        if images and self.prompt_cache.budget_bytes > 0:
            return _batch(self._encode_reusing(images, expected, rows))
        vision = self._vision_inputs(images, expected)
        length = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for b, row in enumerate(rows):  # left padding
            input_ids[b, length - len(row):] = torch.tensor(row, dtype=torch.long)
            attention_mask[b, length - len(row):] = 1
        inputs = {
            "input_ids": input_ids.to(device),
            "attention_mask": attention_mask.to(device),
            # text 0, image 1: what transformers' processor returns; it drives the 3D (M-RoPE) positions
            "mm_token_type_ids": (input_ids == self.image_token_id).long().to(device),
        }
        if vision:  # every prompt carries the same images, one set per prompt, in placeholder order
            inputs["pixel_values"] = vision["pixel_values"].repeat(len(rows), 1).to(device)
            inputs["image_grid_thw"] = vision["image_grid_thw"].repeat(len(rows), 1).to(device)
        hidden = self.model(**inputs, use_cache=False).last_hidden_state  # (B, length, hidden), norm is identity
        encoded = []
        for b, row in enumerate(rows):
            keep = slice(length - len(row) + self.drop_tokens, length)
            ids = input_ids[b, keep].to(device)
            encoded.append(EncodedPrompt(embeds=hidden[b, keep].clone(), image_slots=ids == self.image_token_id,
                                         token_ids=ids))
        return _batch(encoded)

    def _cache_argument(self) -> str:
        """transformers' name for a forward's key/value cache: `cache` (>= 5.2x), `past_key_values` before."""
        return "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def _vision_output(self, image: Image.Image, slots: int) -> tuple[str, VisionOutput]:
        """(key, vision-tower output) of one reference, from `prompt_cache` when it was seen at this size."""
        key = "vision:" + image_key(image, image.size)
        kept = self.prompt_cache.get(key)
        if kept is None:
            vision = self._vision_inputs([image], [slots])
            grid = vision["image_grid_thw"].to(self.device)
            got = self.model.get_image_features(vision["pixel_values"].to(self.device), grid, return_dict=True)
            kept = VisionOutput(got.pooler_output[0], tuple(layer[0] for layer in got.deepstack_features),
                                tuple(vision["image_grid_thw"][0].tolist()))
            self.prompt_cache.put(key, kept)
        return key, kept

    def _encode_reusing(self, images, expected, rows) -> list["EncodedPrompt"]:
        """Each prompt as `encode` gives it, the leading run (up to the last `<|vision_end|>`, the same for every
        prompt with these references) run once and kept, so only each prompt's instruction tokens run here."""
        device = self.device
        lead = max(i for i, token in enumerate(rows[0]) if token == self.vision_end_id) + 1
        if any(row[:lead] != rows[0][:lead] for row in rows):
            raise ValueError("prompts with the same references must share the template up to the last reference.")
        vision = [self._vision_output(image, slots) for image, slots in zip(images, expected)]
        grids = torch.tensor([output.grid for _, output in vision], dtype=torch.long)
        key = "lead:" + run_key(rows[0][:lead], [key for key, _ in vision])
        run = self.prompt_cache.get(key)
        self.last_reused_tokens = lead if run is not None else 0
        positions = []
        for row in rows:  # M-RoPE positions of the whole prompt, sliced for the leading run and the instruction
            ids = torch.tensor(row, dtype=torch.long)[None]
            positions.append(self.model.get_rope_index(ids, (ids == self.image_token_id).long(), grids)[0])
        if run is None:
            ids = torch.tensor(rows[0][:lead], dtype=torch.long)[None].to(device)
            depth = len(vision[0][1].deepstack)
            outputs = _VisionBatch([o.tokens.to(device) for _, o in vision],
                                   [[o.deepstack[j].to(device) for _, o in vision] for j in range(depth)])
            out = self.model(input_ids=ids, position_ids=positions[0][:, :, :lead].to(device), use_cache=True,
                             mm_encoder_outputs={"image": outputs})
            kept = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
            run = LeadingRun(out.last_hidden_state[0], tuple((layer.keys, layer.values) for layer in kept.layers))
            self.prompt_cache.put(key, run)
            run = self.prompt_cache.get(key) or run  # the kept copy: the same bits every later encoding returns
        states = run.states.to(device)
        encoded = []
        for row, position in zip(rows, positions):
            past = DynamicCache(config=self.model.config.text_config)
            for layer, (k, v) in enumerate(run.layers):
                past.update(k.to(device), v.to(device), layer)
            suffix = torch.tensor(row[lead:], dtype=torch.long)[None].to(device)
            out = self.model(input_ids=suffix, position_ids=position[:, :, lead:].to(device), use_cache=True,
                             **{self._cache_argument(): past})
            hidden = torch.cat([states, out.last_hidden_state[0]])
            ids = torch.tensor(row, dtype=torch.long, device=device)[self.drop_tokens :]
            encoded.append(EncodedPrompt(embeds=hidden[self.drop_tokens :].clone(),
                                         image_slots=ids == self.image_token_id, token_ids=ids))
        return encoded

    def encode(self, prompt: str, references: Sequence = ()) -> EncodedPrompt:
        """Encode one prompt with its references: `(L, hidden)` states and the `(L,)` image-slot mask."""
        if not isinstance(prompt, str):
            raise TypeError(f"encode takes one prompt string, got {type(prompt).__name__}; use encode_batch for lists.")
        return self.encode_batch([prompt], references).prompts[0]
