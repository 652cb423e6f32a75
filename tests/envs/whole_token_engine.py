"""A scripted engine for the environment tests (a real `Engine`; scripting is the stated test method).

The tiny tokenizer registers each whole tool call / answer as one token, so a
script is a list of such tokens: after i tool observations in the prefix the
engine emits the i-th (the last one repeats).
"""

from trace_mega.rollout.engines.base import Completion, Engine


class WholeTokenEngine(Engine):
    def __init__(self, tok, tokens):
        super().__init__()
        self.tok, self.ids = tok, [tok.convert_tokens_to_ids(t) for t in tokens]

    def generate(self, prefixes, sampling):
        out = []
        for prefix in prefixes:
            seen = self.tok.convert_ids_to_tokens(prefix).count("<tool_response>")
            out.append(
                Completion(token_ids=[self.ids[min(seen, len(self.ids) - 1)]], logprobs=[-0.1], finish_reason="stop")
            )
        return out

    def update_weights(self, named_tensors):
        for _ in named_tensors:  # no weights; consume the stream like a real engine
            pass
