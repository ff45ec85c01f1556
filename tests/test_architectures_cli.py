"""`baton generate --local --model DIR` runs each ported architecture from its folder and
prints what the engine generates."""

from __future__ import annotations

import pytest
from arch_checks import ARCHITECTURES, engine, make_architecture

from serve_app.ops.cli import main
from workers.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_baton_generate_local_runs_the_folder(arch, tmp_path, capsys):
    model_dir = make_architecture(arch, tmp_path / arch)
    llm = engine(model_dir)
    prompt = "The river ran past the mill"
    ids = llm.tokenizer.encode(prompt)
    expected = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0]
    args = ["generate", "--local", "--model", str(model_dir), "--temperature", "0"]
    assert main([*args, "--max-tokens", "12", prompt]) == 0
    assert capsys.readouterr().out == llm.tokenizer.decode(expected.output_token_ids) + "\n"
