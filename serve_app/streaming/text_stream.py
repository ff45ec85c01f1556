"""The router's half of a request's output: text and stop strings.

Engine replicas run with `EngineConfig.detokenize=False` and send token ids only; the
router turns them into text here, with the engine's own incremental detokenizer, so
the output a client sees is exactly what an in-process engine would have produced:
text released only as whole characters, the tail that could still become a stop
string held back, and the output cut right after the token that completes a stop
string. When that happens the request is over for the client; the caller stops
reading the pool, which aborts the request there (its blocks are freed at once).
"""

from __future__ import annotations

from dataclasses import replace

from tokenizers import Tokenizer

from workers.engine import (
    FinishReason,
    IncrementalDetokenizer,
    RequestOutput,
    SamplingParams,
    stops_on_token,
)


def engine_params(params: SamplingParams) -> SamplingParams:
    """What the engine is asked for: everything but the stop strings, applied here."""
    return replace(params, stop=()) if params.stop else params


class TextStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
    ):
        self._params = params
        self._eos = frozenset(eos_token_ids)
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens
        )
        self.stopped = False  # a stop string ended the output here, not in the engine

    def add(self, out: RequestOutput) -> RequestOutput:
        """The engine output `out` with its text, cut after a completed stop string."""
        if self.stopped:
            raise RuntimeError(f"request {out.request_id}: output after its stop string")
        tokens = out.new_token_ids
        kept = len(tokens)
        engine_stopped = out.finish_reason is FinishReason.STOP
        before = out.num_output_tokens - len(tokens)  # output tokens ahead of this message
        for i, token in enumerate(tokens):
            # The engine stopped on a stop token or EOS: kept, but it adds no text.
            last = i == kept - 1
            if last and engine_stopped and stops_on_token(token, self._params, self._eos):
                break
            # Stop strings wait for min_tokens, as in the engine.
            check_stop = before + i + 1 >= self._params.min_tokens
            if self._detokenizer.add_token(token, check_stop):
                self.stopped, kept = True, i + 1
                break
        if self.stopped:
            finished = True
        else:
            # An abort ends the output early: what is held back is never released.
            finished = out.finished and out.finish_reason is not FinishReason.ABORT
        text = self._detokenizer.release(finished=finished)
        if not self.stopped:
            return replace(out, new_text=text)
        return replace(
            out,
            new_token_ids=tokens[:kept],
            new_text=text,
            new_logprobs=out.new_logprobs[:kept],
            finished=True,
            finish_reason=FinishReason.STOP,
            num_output_tokens=out.num_output_tokens - (len(tokens) - kept),
            handoff=None,
        )
