"""The tokenizer of a GGUF file, rebuilt as a Hugging Face `tokenizers` BPE.

llama.cpp keeps the vocabulary, merges and token types in the GGUF metadata. Two kinds
(`tokenizer.ggml.model`) are rebuilt:

- `gpt2`, byte-level BPE: llama.cpp picks its pre-tokenizer regexes by name
  (`tokenizer.ggml.pre`); this module reproduces that choice so the converted
  `tokenizer.json` splits text exactly as llama.cpp does.
- `llama`, SentencePiece BPE (Gemma): a space is written "▁", an unknown byte as its
  `<0xNN>` token. The file lists no merges; they are recovered from the vocabulary,
  ranked by the merged token's place in the file (its vocabulary order is its merge
  order) and, among a token's splits, longer left part first: the ranking
  transformers' GGUF loader builds, so both tokenize a text alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

if TYPE_CHECKING:
    from workers.model.gguf_metadata import GGUFMetadata

__all__ = ["build_tokenizer", "tokenizer_config"]

# tokenizer.ggml.pre values, grouped by the pre-tokenizer regexes llama.cpp's llama-vocab.cpp
# selects for them. "digits+gpt2": llama.cpp first isolates every \p{N} character (tokenizers'
# Digits(individual_digits=True); Rust's is_numeric is the same \p{N} class), then applies the
# GPT-2 regex (ByteLevel(use_regex=True)). This is also what SmolLM2's own tokenizer.json does.
_PRE_KINDS = {
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b"),
        "digits+gpt2",
    ),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais"), "gpt2"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), "llama3"),
}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp token types (enum llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
_SPACE = "\u2581"


def build_tokenizer(meta: GGUFMetadata) -> Tokenizer:
    """The tokenizer this file describes, special tokens included."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta)
    else:
        raise ValueError(
            f"tokenizer model {kind!r} is not supported; byte-level BPE ('gpt2') and "
            "SentencePiece BPE ('llama') are"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type", None) or []
    # normalized=False: these must match the raw text, e.g. "<|im_start|>" typed into a prompt.
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == _CONTROL
        ]
    )
    # A user-defined run of spaces is matched in the vocabulary under its "▁" spelling, not
    # as written; adding it as written would give it a new id.
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == _USER_DEFINED and tokenizer.token_to_id(tokens[i]) == i
        ]
    )
    tokenizer.post_processor = _post_processor(meta, tokens, byte_level=kind == "gpt2")
    return tokenizer


def _sentencepiece_bpe(meta: GGUFMetadata) -> Tokenizer:
    # Runs of spaces are stored with real spaces; text reaches the model with them as "▁".
    tokens = [
        t.replace(" ", _SPACE) if t and not t.strip() else t
        for t in meta.get("tokenizer.ggml.tokens")
    ]
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    merges = _merges(meta)
    if not merges:  # as Gemma's files: recovered from the vocabulary
        for token in tokens:
            splits = [(token[:k], token[k:]) for k in range(len(token) - 1, 0, -1)]
            merges.extend((a, b) for a, b in splits if a in vocab and b in vocab)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", None)
    bpe = models.BPE(
        vocab=vocab,
        merges=merges,
        unk_token=None if unk_id is None else tokens[int(unk_id)],
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    replace_space = normalizers.Replace(" ", _SPACE)
    decode = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        # A space put before the text on encode is taken off on decode.
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace_space])
        decode.append(decoders.Strip(" ", 1, 0))
    else:
        tokenizer.normalizer = replace_space
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer


def _merges(meta: GGUFMetadata, required: bool = False) -> list[tuple[str, str]]:
    """The file's BPE merges, "left right" each (empty if it lists none)."""
    merges = []
    for merge in meta.get("tokenizer.ggml.merges", ... if required else None) or []:
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ValueError(f"malformed BPE merge {merge!r}")
        merges.append((pair[0], pair[1]))
    return merges


def _byte_level_bpe(meta: GGUFMetadata) -> Tokenizer:
    """The byte-level BPE tokenizer llama.cpp would run for this file."""
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    merges = _merges(meta, required=True)
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    # Required: llama.cpp's fallback for a missing value is its own regex set, not GPT-2's.
    pre = meta.get("tokenizer.ggml.pre")
    # llama.cpp's llama3 family looks a whole word up in the vocabulary before merging.
    ignore_merges = _PRE_KINDS.get(pre) == "llama3"
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=ignore_merges)
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = None
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre, add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _pre_tokenizer(pre: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    kind = _PRE_KINDS.get(pre)
    if kind is None:
        # A guessed split would tokenize most text right and some wrong: worse than failing.
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}; supported: {sorted(_PRE_KINDS)}")
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=add_prefix_space, use_regex=kind != "llama3"
    )
    if kind == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind == "llama3":
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    return byte_level


def _adds_bos_eos(meta: GGUFMetadata) -> tuple[bool, bool]:
    # llama.cpp turns BOS on for SentencePiece and the llama3 family unless the file says
    # otherwise.
    default = (
        meta.get("tokenizer.ggml.model") == "llama"
        or _PRE_KINDS.get(meta.get("tokenizer.ggml.pre", None)) == "llama3"
    )
    return (
        bool(meta.get("tokenizer.ggml.add_bos_token", default)),
        bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )


def _post_processor(
    meta: GGUFMetadata, tokens: list[str], byte_level: bool
) -> processors.PostProcessor | None:
    """Add BOS/EOS on encode exactly when llama.cpp would."""
    wrap: dict[str, tuple[str, int]] = {}
    for name, wanted in zip(("bos", "eos"), _adds_bos_eos(meta), strict=True):
        if wanted:
            token_id = int(meta.get(f"tokenizer.ggml.{name}_token_id"))
            wrap[name] = (tokens[token_id], token_id)
    if not wrap:
        return processors.ByteLevel(trim_offsets=False) if byte_level else None

    def sequence(piece: str) -> list[str]:
        bos, eos = wrap.get("bos"), wrap.get("eos")
        return [*([bos[0]] if bos else []), piece, *([eos[0]] if eos else [])]

    return processors.TemplateProcessing(
        single=sequence("$A"),
        pair=sequence("$A") + sequence("$B:1"),
        special_tokens=list(wrap.values()),
    )


def tokenizer_config(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special tokens, BOS/EOS on encode, the chat template."""
    tokens = meta.get("tokenizer.ggml.tokens")
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _adds_bos_eos(meta)[0],
        "add_eos_token": _adds_bos_eos(meta)[1],
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None:
            out[f"{name}_token"] = tokens[int(token_id)]
    template = meta.get("tokenizer.chat_template", None)
    if template is not None:
        out["chat_template"] = template
    return out
