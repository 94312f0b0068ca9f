"""The tiny model set's tokenizer: a small byte-level BPE trained here in Qwen2's file format (with Qwen2's added
tokens at their real ids), and the diffusers `processor/` folder around it. Generated, never copied; the text
encoder tests (tests/te_fixtures.py) and `tiny_checkpoints.py` share it."""

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX  # Qwen2Tokenizer's pre-tokenizer split

from ..model.encoders.prompt_template import SYSTEM_PROMPT
from ..model.loaders.text_encoder import IMAGE_PROCESSOR_DEFAULTS

#: Qwen2's added tokens at their real ids (id, text, special), as Qwen2/Qwen2.5/Qwen3-VL tokenizers list them.
QWEN_ADDED_TOKENS = tuple((151643 + i, text, special) for i, (text, special) in enumerate((
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)))
FIRST_ADDED_ID = QWEN_ADDED_TOKENS[0][0]
QWEN_VOCAB_ROWS = 151936  # Qwen3-VL's embedding rows (the added tokens end at 151668; the rest is padding)

#: What the generated BPE learns from: the template words, the system prompt, the test prompts and some English.
#: The text encoder tests count tokens of this BPE: changing the corpus changes their numbers.
TOKENIZER_CORPUS = (
    "system", "user", "assistant", SYSTEM_PROMPT, "<image1> <image2> <image3>",
    "A cat", "a much longer prompt about <image1> and a dog", "Put <image1> on the left",
    "<image1> in the style of the last one", "<image1> at dusk", "<image1> on a table", "two",
    "A photograph of a cat sitting on a wooden table next to a window, soft morning light.",
    "The dog runs across the green field while the children watch from the hill.",
    "Render the scene in the style of an old oil painting, with warm colours and visible brush strokes.",
    "Replace the background with a quiet street at night, keeping the person in the foreground unchanged.",
    "A red bicycle leans against a brick wall covered in ivy; the shadows are long and the sky is orange.",
    "Write the words \"OPEN 24 HOURS\" on the neon sign above the door of the small shop.",
    "Two people are talking in a cafe. One of them holds a cup of coffee, the other one is laughing.",
    "Make it look like a watercolour illustration for a children's book about the sea and its animals.",
)


def write_qwen2_tokenizer(folder: Path, vocab_size: int = 1024) -> Path:
    """Train a small byte-level BPE on `TOKENIZER_CORPUS` and write it in Qwen2's file format; returns `folder`.

    The files are what ComfyUI's bundled `qwen25_tokenizer/` holds: vocab.json + merges.txt +
    tokenizer_config.json. Qwen2's normalizer and pre-tokenizer are used, so the merges fit the way
    `Qwen2Tokenizer` splits text. vocab.json holds the 256 byte symbols and the learned merges, padded with
    `<unused N>` entries to id 151642 so that the added tokens land on their real ids (transformers appends added
    tokens after the vocabulary instead of honouring the ids listed); byte-level BPE never produces those
    entries, since a space is never a byte-level symbol.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(TOKENIZER_CORPUS, trainer)
    learned = json.loads(bpe.to_str())["model"]
    vocab, merges = learned["vocab"], learned["merges"]
    if sorted(vocab.values()) != list(range(len(vocab))) or len(vocab) >= FIRST_ADDED_ID:
        raise RuntimeError(f"the trained BPE has {len(vocab)} non-contiguous or too many ids")
    vocab.update({f"<unused {i}>": i for i in range(len(vocab), FIRST_ADDED_ID)})
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = [" ".join(pair) if isinstance(pair, list) else pair for pair in merges]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(lines) + "\n", encoding="utf-8")
    added = {str(i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": special} for i, text, special in QWEN_ADDED_TOKENS}
    config = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": [t for _, t, special in QWEN_ADDED_TOKENS[1:] if special],
        "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "extra_special_tokens": {}, "model_max_length": 131072, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


def write_processor(tokenizer_dir: Path, folder: Path) -> Path:
    """A diffusers `processor/` folder: the tokenizer as transformers 5 saves it (tokenizer.json +
    tokenizer_config.json) and the released image-processor settings (`preprocessor_config.json`)."""
    folder = Path(folder)
    Qwen2Tokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True).save_pretrained(str(folder))
    settings = dict(IMAGE_PROCESSOR_DEFAULTS, image_processor_type="Qwen2VLImageProcessorFast",
                    processor_class="Qwen3VLProcessor", do_resize=True, do_rescale=True, do_normalize=True,
                    do_convert_rgb=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    return folder
