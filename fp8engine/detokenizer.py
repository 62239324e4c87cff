"""Text of a growing list of output tokens without decoding the whole list at every step.

Streaming callers (`LLMEngine.step`, the server) want each unfinished sequence's text after every
token; decoding everything generated so far each time is O(length) per token. A sequence keeps the
text of a prefix whose last character is complete, and each call decodes only the tokens after it
plus a few before it for context (byte-level and SentencePiece decoders treat the first token of a
decode specially; the context makes both decodes agree on it), taking the new text as the
difference. Tokenizers that clean up spaces across tokens fall back to a whole decode.
"""

from dataclasses import dataclass

CONTEXT_TOKENS = 6
REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to


@dataclass(slots=True)
class DetokState:
    upto: int = 0   # tokens whose text is settled
    text: str = ""  # their text


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.incremental = not getattr(tokenizer, "clean_up_tokenization_spaces", False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self, state: DetokState, ids: list[int]) -> str:
        """decode(ids), where ids extends the ids of earlier calls with the same state."""
        if not self.incremental or state.upto > len(ids):
            return self.decode(ids)
        start = max(0, state.upto - CONTEXT_TOKENS)
        head = self.decode(ids[start:state.upto]) if state.upto > start else ""
        tail = self.decode(ids[start:])
        if not tail.startswith(head):
            return self.decode(ids)
        text = state.text + tail[len(head):]
        if not text.endswith(REPLACEMENT):  # a complete last character: settle it
            state.upto, state.text = len(ids), text
        return text
