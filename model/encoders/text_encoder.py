"""The Qwen-Image 2.1 text encoder: Qwen3-VL-8B reading the prompt and the references together.

The language model and vision tower are transformers' own (`Qwen3VLModel`, the body of
`Qwen3VLForConditionalGeneration` without its LM head, which conditioning never uses); this module only
builds their inputs and picks their outputs the way the reference pipeline does (diffusers 0.42.1
`QwenImage21Pipeline._get_qwen_prompt_embeds`; the template and the token accounting are in
docs/checkpoints.md, "Text encoder"):

- the prompt goes into the fixed template of `prompt_template.py` (the token ids and every check that needs no
  model live there);
- prompts of a batch are left-padded, as the checkpoint was trained;
- the output is the LAST decoder layer's hidden state BEFORE the final RMSNorm. The model is built with that
  norm replaced by an identity, so `last_hidden_state` is exactly that state (diffusers hooks the norm to an
  identity for the same reason: transformers >= 5 returns the normed state in `hidden_states[-1]`);
- padding is removed and the system turn is dropped;
- `image_slots` marks the `<|image_pad|>` positions that remain: the DiT puts 2x2 latent tokens of the
  matching reference at each one.

`interruptible` lets a caller stop an encoding between layers, a guard the reference pipeline lacks. Loading
from files lives in `loaders/text_encoder.py`.
"""

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from PIL import Image
from torch import nn
from transformers import DynamicCache

from .prompt_cache import LeadingRun, PromptCache, VisionOutput, image_key, run_key
from .prompt_template import MAX_ROPE_POSITIONS, PromptTokenizer


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
        self.source = source
        self.preferred_device: torch.device | None = None
        #: the template, the token ids and every check that needs no model (prompt_template.py)
        self.prompts = PromptTokenizer(tokenizer, image_processor, model.config, max_positions)
        #: vision outputs and the leading run's keys/values kept between encodings (prompt_cache.py);
        #: `prompt_cache.budget_bytes = 0` turns reuse off
        self.prompt_cache = PromptCache()
        self.last_reused_tokens = 0  # leading tokens the last encoding took from `prompt_cache`

    @property
    def tokenizer(self):
        return self.prompts.tokenizer

    @property
    def drop_tokens(self) -> int:
        """Leading tokens (the system turn) every encoding drops from its output."""
        return self.prompts.drop_tokens

    @property
    def image_token_id(self) -> int:
        return self.prompts.image_token_id

    @property
    def vision_end_id(self) -> int:
        return self.prompts.vision_end_id

    @property
    def max_positions(self) -> int:
        """Frame positions a prompt with its references may take in the DiT sequence."""
        return self.prompts.max_positions

    @max_positions.setter
    def max_positions(self, value: int) -> None:
        self.prompts.max_positions = value

    def check_prompt(self, prompt: str, references: Sequence = ()) -> None:
        """Raise ValueError for what `encode(prompt, references)` would refuse, without running the model."""
        self.prompts.check_prompt(prompt, references)

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
        images, expected, rows = self.prompts.prepare(prompts, references)
        self.last_reused_tokens = 0
        if images and self.prompt_cache.budget_bytes > 0:
            return _batch(self._encode_reusing(images, expected, rows))
        vision = self.prompts.vision_inputs(images, expected)
        length = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), length), self.prompts.pad_token_id, dtype=torch.long)
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
            vision = self.prompts.vision_inputs([image], [slots])
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
