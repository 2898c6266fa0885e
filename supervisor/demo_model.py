"""The built-in demo model: a Llama with random weights and a locally trained tokenizer, no downloads.

``build_demo_model(out_dir, size)`` writes an ordinary Hugging Face model folder (``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``) that ``transformers`` loads as is (``AutoModelForCausalLM`` /
``AutoTokenizer``); ``demo_model_dir(size)`` keeps one copy per size in the user's cache.

Everything is deterministic: the same size and seed give byte-identical files on any machine.

- Tokenizer: byte-level BPE trained with ``tokenizers`` on a corpus generated here from a fixed seed
  (pseudo-words from syllables, a few English function words, punctuation, numbers, accented words,
  CJK, emoji, code-ish lines), trained until the vocabulary is exactly ``vocab_size``. Special tokens
  (ids 0..4): ``<s>``, ``</s>``, ``<pad>``, ``<|im_start|>``, ``<|im_end|>``. The post-processor prepends
  ``<s>``; the chat template is ChatML and starts with ``<s>`` itself, so a rendered chat prompt is
  tokenized with ``add_special_tokens=False`` (as ``apply_chat_template(tokenize=True)`` and TGI do).
- Weights: every tensor is drawn from its own ``torch.Generator`` seeded from (seed, tensor name), in
  float32, so the result does not depend on the order in which ``transformers`` initialises modules.
  Linear and embedding weights are N(0, init_std); norm weights are 1. The tiny model uses a large
  ``init_std`` so greedy decoding has wide top-1/top-2 logit margins (random models otherwise have
  near-tied logits and fragile greedy outputs).
- Config files are written by hand (sorted keys, no ``transformers_version``) so they do not depend
  on the installed ``transformers``.

Import this module only where it is needed (the CLI); no package ``__init__`` imports it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

__all__ = ["SIZES", "DEFAULT_INIT_STD", "SPECIAL_TOKENS", "CHAT_TEMPLATE", "build_demo_model",
           "demo_model_dir"]

# Bump when the files' contents change for the same size and seed (the cache directory name has it).
FORMAT_VERSION = 1

# The LlamaConfig keyword arguments per size (plus ``dtype``: the weights' dtype in model.safetensors).
SIZES: dict[str, dict[str, Any]] = {
    # ~2M parameters: for tests.
    "tiny": dict(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        dtype="float32",
    ),
    # ~125M parameters: the default demo.
    "small": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
}

# Std of the N(0, std) linear/embedding weights when ``init_std`` is not given: larger than the usual 0.02,
# so that greedy decoding has wide top-1/top-2 margins and small no longer falls into short loops (design
# notes, "The demo models' weight scale").
DEFAULT_INIT_STD: dict[str, float] = {"tiny": 0.5, "small": 0.1}

BOS, EOS, PAD, IM_START, IM_END = "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]  # ids 0..4, in this order

# ChatML. Content may be a string or a list of OpenAI-style parts (only the text parts are kept).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS_SEED = 20240601  # the tokenizer does not depend on the model seed, only on the vocab size


# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "kr", "ph", "pl", "pr", "qu", "sh",
           "sk", "sl", "sm", "sn", "sp", "st", "str", "sw", "th", "tr", "wh"]
_VOWELS = ["a", "e", "i", "o", "u", "y", "ai", "au", "ea", "ee", "ei", "ie", "oa", "oo", "ou"]
_CODAS = ["", "", "", "b", "ck", "d", "f", "g", "l", "ll", "m", "n", "nd", "ng", "nk", "nt", "p", "r",
          "rd", "rk", "rn", "rt", "s", "ss", "st", "t", "th", "x"]
_SUFFIXES = ["", "", "", "", "s", "ed", "ing", "er", "ly", "tion", "ness", "ment", "able", "ist"]
_ACCENTED_VOWELS = ["á", "à", "â", "ä", "é", "è", "ê", "ë", "í", "î", "ï", "ó", "ô", "ö", "ú", "ù",
                    "û", "ü", "ñ", "ç", "ø", "å", "æ", "œ", "ß", "ã", "õ"]
_FUNCTION_WORDS = ("the of and to a in is that it for was on are as with be by at this have from or "
                   "an but not what all were when we there can your which their said if will each "
                   "about how up out them then she many some so these would other into has more her "
                   "two like him see time could no make than first been its who now people my made "
                   "over did down only way find use may water long little very after word called just "
                   "where most know get through back much go good new write our me man too any day "
                   "same right look think also around another came come work three must because does "
                   "part even place well such here take why help put different away again off went "
                   "old number great tell men say small every found still between name should home "
                   "big give air line set own under read last never us left end along while might "
                   "next sound below saw something thought both few those always show large often "
                   "together asked house world going want school important until form food keep "
                   "children feet land side without boy once animal life enough took four head above "
                   "kind began almost live page got earth need far hand high year mother light country "
                   "father let night picture being study second soon story since white ever paper hard "
                   "near sentence better best across during today however sure knew try told young sun "
                   "hello yes please thank you model token server request answer question").split()
_CODE_WORDS = ["def", "return", "if", "else", "for", "in", "import", "from", "class", "self", "None",
               "True", "False", "print", "len", "range", "while", "try", "except", "with", "as", "lambda",
               "yield", "const", "let", "function", "var", "null", "int", "str", "list", "dict"]
_PUNCT_END = [".", ".", ".", ".", "!", "?", "...", ";"]
_PUNCT_MID = [",", ",", ",", ":", " -", " (", ")", "\"", "'"]
_EMOJI = [chr(c) for c in range(0x1F600, 0x1F650)] + [chr(c) for c in range(0x1F300, 0x1F330)] + [
    "❤️", "👍", "🚀", "✨", "🎉", "🔥", "✅", "⭐"]


def _zipf_cum(n: int, s: float = 1.07) -> list[float]:
    """Cumulative Zipf weights (for ``random.choices(cum_weights=...)``, which is O(log n) per draw)."""
    out, acc = [], 0.0
    for k in range(n):
        acc += 1.0 / (k + 1) ** s
        out.append(acc)
    return out


class _CorpusGen:
    """A deterministic, varied pseudo-language; only ``random.Random`` and lists (no set/hash order)."""

    def __init__(self, seed: int, n_words: int) -> None:
        self.rng = rng = random.Random(seed)
        self.words = self._lexicon(n_words, accented=False)
        self.accented = self._lexicon(max(200, n_words // 8), accented=True)
        self.word_w = _zipf_cum(len(self.words))
        self.acc_w = _zipf_cum(len(self.accented))
        self.func_w = _zipf_cum(len(_FUNCTION_WORDS), 0.8)
        # ~1500 common CJK characters; "words" of 1-4 of them.
        cjk = [chr(0x4E00 + rng.randrange(0x5000)) for _ in range(1500)]
        self.cjk_words = ["".join(rng.choice(cjk[: rng.choice([100, 400, 1500])])
                                  for _ in range(rng.choice([1, 2, 2, 3, 4])))
                          for _ in range(max(300, n_words // 6))]
        self.cjk_w = _zipf_cum(len(self.cjk_words))
        kana = [chr(c) for c in range(0x3041, 0x3097)] + [chr(c) for c in range(0x30A1, 0x30FB)]
        self.kana_words = ["".join(rng.choice(kana) for _ in range(rng.randint(2, 5)))
                           for _ in range(max(100, n_words // 20))]
        cyr = [chr(c) for c in range(0x0430, 0x0450)]
        self.cyr_words = ["".join(rng.choice(cyr) for _ in range(rng.randint(2, 9)))
                          for _ in range(max(100, n_words // 20))]

    def _lexicon(self, n: int, accented: bool) -> list[str]:
        rng, out, seen = self.rng, [], {}
        while len(out) < n:
            parts = []
            for _ in range(rng.choice([1, 1, 2, 2, 2, 3, 3, 4])):
                v = rng.choice(_VOWELS)
                if accented and rng.random() < 0.35:
                    v = rng.choice(_ACCENTED_VOWELS)
                parts.append(rng.choice(_ONSETS) + v + rng.choice(_CODAS))
            w = "".join(parts) + rng.choice(_SUFFIXES)
            if w not in seen:
                seen[w] = None
                out.append(w)
        return out

    def _number(self) -> str:
        rng = self.rng
        k = rng.randrange(8)
        if k == 0:
            return str(rng.randint(1900, 2030))
        if k == 1:
            return f"{rng.randint(0, 999)}.{rng.randint(0, 99):02d}"
        if k == 2:
            return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        if k == 3:
            return f"{rng.randint(1, 100)}%"
        if k == 4:
            return f"{rng.randint(1000, 999999):,}"
        return str(rng.randint(0, 10 ** rng.randint(1, 4)))

    def _word(self) -> str:
        rng = self.rng
        r = rng.random()
        if r < 0.38:
            return rng.choices(_FUNCTION_WORDS, cum_weights=self.func_w)[0]
        if r < 0.94:
            return rng.choices(self.words, cum_weights=self.word_w)[0]
        if r < 0.985:
            return self._number()
        return rng.choice(_EMOJI)

    def sentence(self) -> str:
        rng = self.rng
        kind = rng.random()
        if kind < 0.06:  # CJK
            s = "".join(rng.choices(self.cjk_words, cum_weights=self.cjk_w, k=rng.randint(2, 12)))
            return s + rng.choice(["。", "，", "！", "？", "", "."])
        if kind < 0.08:
            return "".join(rng.choice(self.kana_words) for _ in range(rng.randint(2, 6))) + "。"
        if kind < 0.10:
            return " ".join(rng.choice(self.cyr_words) for _ in range(rng.randint(3, 10))).capitalize() + "."
        if kind < 0.16:  # accented pseudo-language
            ws = rng.choices(self.accented, cum_weights=self.acc_w, k=rng.randint(3, 12))
            return " ".join(ws).capitalize() + rng.choice(_PUNCT_END)
        if kind < 0.21:  # code-ish
            ind = " " * rng.choice([0, 0, 4, 8])
            a, b = rng.choice(self.words[:2000]), rng.choice(self.words[:2000])
            return rng.choice([
                f"{ind}def {a}_{b}(self, {a}):",
                f"{ind}return {a}[{rng.randint(0, 9)}] + {b}",
                f"{ind}if {a} == {self._number()}:",
                f"{ind}{a} = {{\"{b}\": {self._number()}, \"{a}\": None}}",
                f"{ind}for {a} in range(len({b})):",
                f"{ind}{rng.choice(_CODE_WORDS)} {a}.{b}({rng.choice(_CODE_WORDS)})",
                f"{ind}// {a} {b}",
                f"{ind}# {a} {b}",
            ])
        n = rng.randint(3, 18)
        out = []
        for i in range(n):
            w = self._word()
            if i == 0 or rng.random() < 0.04:
                w = w[:1].upper() + w[1:]
            if i and rng.random() < 0.09:
                p = rng.choice(_PUNCT_MID)
                out[-1] += p if p != " (" else ""
                if p == " (":
                    w = "(" + w
            out.append(w)
        return " ".join(out) + rng.choice(_PUNCT_END)

    def paragraphs(self, n_sentences: int, batch: int = 256) -> Iterator[str]:
        rng, buf = self.rng, []
        for _ in range(n_sentences):
            buf.append(self.sentence())
            if rng.random() < 0.15:
                buf.append("\n\n" if rng.random() < 0.5 else "\n")
            else:
                buf.append(" ")
            if len(buf) >= batch:
                yield "".join(buf)
                buf = []
        if buf:
            yield "".join(buf)


def _corpus(vocab_size: int) -> Iterator[str]:
    n_words = max(2000, vocab_size)
    gen = _CorpusGen(_CORPUS_SEED, n_words)
    # ~4 sentences per lexicon word: the trainer could go to >4x vocab_size merges on it (asserted below).
    return gen.paragraphs(n_sentences=4 * n_words)


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=16,
    )
    tok.train_from_iterator(_corpus(vocab_size), trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise RuntimeError(f"demo tokenizer: trained vocab is {got}, wanted {vocab_size} (corpus too small)")
    if [tok.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError("demo tokenizer: special tokens did not get ids 0..4")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, 0)]
        ),
    ])
    return tok


def _tokenizer_config(model_max_length: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
            "additional_special_tokens": [IM_START, IM_END]}


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------

def _model_config(size: str, init_std: float) -> dict[str, Any]:
    kw = dict(SIZES[size])
    dtype = kw.pop("dtype")
    rope_theta = kw.pop("rope_theta")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **kw,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        # Informational only (the weights are in the file); transformers 5 rejects values above 1.
        "initializer_range": min(init_std, 1.0),
        # Both spellings: transformers >= 5 reads rope_parameters (and dtype), 4.x reads rope_theta
        # (and torch_dtype).
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
    }


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
    }


def _tensor_seed(seed: int, name: str) -> int:
    h = hashlib.sha256(f"llmbus-demo/{seed}/{name}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _random_state_dict(config_dict: dict[str, Any], seed: int, init_std: float) -> dict[str, Any]:
    """The weights, named and shaped as ``LlamaForCausalLM(config)`` has them, each drawn from its own
    generator (so neither the module init order of ``transformers`` nor the tensor order matters)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    skip = ("dtype", "torch_dtype", "rope_scaling")
    cfg = LlamaConfig(**{k: v for k, v in config_dict.items() if k not in skip})
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(cfg).state_dict().items()}
    if config_dict["tie_word_embeddings"]:
        shapes.pop("lm_head.weight", None)
    dtype = getattr(torch, config_dict["dtype"])
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):  # input_layernorm, post_attention_layernorm, model.norm
            t = torch.ones(shape, dtype=torch.float32)
        elif name.endswith(".weight") and len(shape) == 2:  # Linear and Embedding
            g = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
            t = torch.empty(shape, dtype=torch.float32).normal_(0.0, init_std, generator=g)
        else:
            raise RuntimeError(f"demo model: no init rule for {name} {shape}")
        out[name] = t.to(dtype).contiguous()
    return out


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------

def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def build_demo_model(
    out_dir: str | Path, size: str = "tiny", *, seed: int = 0, init_std: float | None = None
) -> Path:
    """Write config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json
    and special_tokens_map.json into ``out_dir`` (created if missing) and return it as a Path.

    Deterministic: the same size, seed and init_std give byte-identical files on any machine (given the
    same ``torch`` CPU generator and ``tokenizers`` trainer, both stable across versions in practice).
    """
    from safetensors.torch import save_file

    if size not in SIZES:
        raise ValueError(f"unknown demo model size {size!r}; choose from {sorted(SIZES)}")
    if init_std is None:
        init_std = DEFAULT_INIT_STD[size]
    if not init_std > 0:
        raise ValueError(f"init_std must be > 0, got {init_std}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    config = _model_config(size, float(init_std))
    tok = _train_tokenizer(config["vocab_size"])
    # tokenizers writes its JSON with a stable key order; pretty=True matches what HF repos ship.
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(config["max_position_embeddings"]))
    _write_json(out / "special_tokens_map.json", _special_tokens_map())

    state = _random_state_dict(config, seed, float(init_std))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config())
    for f in _REQUIRED_FILES:
        os.chmod(out / f, 0o644)  # safetensors writes 0600
    return out


def _cache_root() -> Path:
    if os.environ.get("LLMBUS_CACHE"):
        return Path(os.environ["LLMBUS_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "llmbus"
    return Path.home() / ".cache" / "llmbus"


_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json")


def _complete(d: Path) -> bool:
    return all((d / f).is_file() for f in _REQUIRED_FILES)


def demo_model_dir(size: str = "small") -> Path:
    """The cached demo model folder ``<cache>/demo-<size>-v1``, built on first use.

    ``<cache>`` is ``$LLMBUS_CACHE``, else ``$XDG_CACHE_HOME/llmbus``, else ``~/.cache/llmbus``. The build
    goes into a temporary folder beside the final one and is renamed into place, so concurrent callers
    (processes) never see a half-written folder; when two build at once, the first rename wins and the
    other's copy (identical) is discarded.
    """
    if size not in SIZES:
        raise ValueError(f"unknown demo model size {size!r}; choose from {sorted(SIZES)}")
    root = _cache_root()
    final = root / f"demo-{size}-v{FORMAT_VERSION}"
    if _complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    if final.exists():
        # Not built by us (we only ever rename complete folders into place): move it out of the way.
        stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale-", dir=root))
        try:
            os.replace(final, stale / "old")
        except FileNotFoundError:
            pass  # someone else moved it already
        shutil.rmtree(stale, ignore_errors=True)
        if _complete(final):
            return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        build_demo_model(tmp, size)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process renamed its (identical) build into place first.
            if not _complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
